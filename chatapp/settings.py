"""Django settings, read from the environment (see `.env.example` and the README)."""

from pathlib import Path

import environ
from django.utils.csp import CSP

from inference.model_files import DEFAULT_MODEL

BASE_DIR = Path(__file__).resolve().parent.parent

env = environ.Env()
environ.Env.read_env(BASE_DIR / ".env", overwrite=False)

DEBUG = env.bool("DEBUG", default=False)
SECRET_KEY = env.str("SECRET_KEY", default="")
if not SECRET_KEY:
    if not DEBUG:
        from django.core.exceptions import ImproperlyConfigured

        raise ImproperlyConfigured("SECRET_KEY must be set when DEBUG is off (see .env.example).")
    SECRET_KEY = "insecure-development-key-only-used-with-DEBUG-on"  # noqa: S105 (DEBUG only)
ALLOWED_HOSTS = env.list("ALLOWED_HOSTS", default=["localhost", "127.0.0.1", "[::1]"])
CSRF_TRUSTED_ORIGINS = env.list("CSRF_TRUSTED_ORIGINS", default=[])

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django.contrib.postgres",
    "django_htmx",
    "chatapp",
    "chatapp.experiments",
    "router",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "django.middleware.csp.ContentSecurityPolicyMiddleware",
    "django_htmx.middleware.HtmxMiddleware",
]

ROOT_URLCONF = "chatapp.urls"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]
ASGI_APPLICATION = "chatapp.asgi.application"
WSGI_APPLICATION = "chatapp.wsgi.application"

DATABASES = {"default": env.db("DATABASE_URL", default="postgres://postgres@127.0.0.1:5432/chatapp")}
DATABASES["default"]["CONN_MAX_AGE"] = env.int("CONN_MAX_AGE", default=0)
# A pool of connections in each process (psycopg_pool): a request or a Celery task borrows one and gives it
# back, instead of opening its own (about 4 ms of this machine's cores, and a new Postgres backend, each
# time), and statements prepared on a connection stay prepared. 0: no pool (a connection per request, or
# CONN_MAX_AGE's persistent ones; the two cannot be combined). A request waits up to 30 s for a connection:
# while Postgres restarts, the pool reconnects with a growing backoff (1, 2, 4 s ...), so work waits for it
# instead of failing.
DB_POOL_SIZE = env.int("DB_POOL_SIZE", default=0 if DATABASES["default"]["CONN_MAX_AGE"] else 20)
_db_options = DATABASES["default"].setdefault("OPTIONS", {})
# Parameters bound on the server, not quoted into the SQL text by Django: psycopg then prepares a statement
# once a connection has run it DB_PREPARE_THRESHOLD times, and Postgres stops parsing and planning it on
# every call. A turn runs about 35 statements; measured in a stack-only replay, this took Postgres's CPU a
# turn from 24 to 17 ms, and the web's and the node's by 4 ms each.
_db_options.setdefault("server_side_binding", env.bool("DB_SERVER_SIDE_BINDING", default=True))
_db_options.setdefault("prepare_threshold", env.int("DB_PREPARE_THRESHOLD", default=2))
if DB_POOL_SIZE:
    _db_options.setdefault("pool", {"min_size": 1, "max_size": DB_POOL_SIZE, "timeout": 30})
# Postgres ends a session whose transaction waits this long for its next statement (0: never). A process
# frozen mid-transaction (a paused VM, SIGSTOP) otherwise keeps its row locks for as long as it is frozen:
# a node frozen inside its heartbeat kept its own row locked, and its peers' reaper, which skips locked
# node rows, never marked it down, so its turns waited for it. No transaction here waits on Redis, Celery or
# the model between its statements: those calls run outside, or on commit.
DB_IDLE_IN_TRANSACTION_TIMEOUT_S = env.float("DB_IDLE_IN_TRANSACTION_TIMEOUT_S", default=5.0)
if DB_IDLE_IN_TRANSACTION_TIMEOUT_S:
    _idle_option = f"-c idle_in_transaction_session_timeout={int(DB_IDLE_IN_TRANSACTION_TIMEOUT_S * 1000)}"
    _db_options["options"] = f"{_db_options.get('options', '')} {_idle_option}".strip()
# A connection kept from an earlier request is checked before it is lent (one empty round trip), so one
# that a Postgres restart broke is replaced instead of failing the request that gets it.
DATABASES["default"]["CONN_HEALTH_CHECKS"] = True
# Database work of the web's streaming views (event streams, API requests) at once, per web process: each
# holds a connection only for that work, then waits on Redis holding none. Hundreds of streams opening at
# once take turns for these, instead of taking all of Postgres's connections (100 by default).
CHAT_STREAM_DB_SLOTS = env.int("CHAT_STREAM_DB_SLOTS", default=16)
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
]
LOGIN_URL = "login"
# Every login path (the login page, the admin) goes through the limiter in this backend.
AUTHENTICATION_BACKENDS = ["chatapp.login_limits.RateLimitedModelBackend"]
# Failed logins (per username, and per client address) before logins are refused for a while.
LOGIN_MAX_FAILURES = env.int("LOGIN_MAX_FAILURES", default=5)
LOGIN_LOCKOUT_SECONDS = env.int("LOGIN_LOCKOUT_SECONDS", default=300)
LOGIN_REDIRECT_URL = "chat:conversation_list"
LOGOUT_REDIRECT_URL = "login"

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = BASE_DIR / "staticfiles"

SESSION_COOKIE_SECURE = not DEBUG and env.bool("SECURE_COOKIES", default=True)
CSRF_COOKIE_SECURE = SESSION_COOKIE_SECURE
# HTTPS only, once served behind TLS (the same switch as secure cookies). TLS ends at a proxy, which
# must set X-Forwarded-Proto itself (never pass on a client's); plain http is redirected to https.
SECURE_HSTS_SECONDS = 31_536_000 if SESSION_COOKIE_SECURE else 0
SECURE_HSTS_INCLUDE_SUBDOMAINS = SESSION_COOKIE_SECURE
SECURE_SSL_REDIRECT = SESSION_COOKIE_SECURE
SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
# HSTS preloading binds the whole domain for months: the domain's owner decides, not this app.
SILENCED_SYSTEM_CHECKS = ["security.W021"]
SECURE_CONTENT_TYPE_NOSNIFF = True
SECURE_REFERRER_POLICY = "same-origin"
# Scripts, styles and connections from this origin only: the pages have no inline script or style.
SECURE_CSP = {
    "default-src": [CSP.SELF],
    "script-src": [CSP.SELF],
    "style-src": [CSP.SELF],
    "img-src": [CSP.SELF, "data:"],
    "connect-src": [CSP.SELF],
    "frame-ancestors": [CSP.NONE],
    "form-action": [CSP.SELF],
    "base-uri": [CSP.NONE],
    "object-src": [CSP.NONE],
}

REDIS_URL = env.str("REDIS_URL", default="redis://127.0.0.1:6379/0")

# Celery: Redis is the broker. Each node consumes its own queue `node.<name>`;
# the router picks the queue and services pass it to `apply_async(queue=...)`.
CELERY_BROKER_URL = REDIS_URL
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_TASK_IGNORE_RESULT = True
# No result backend is used; sharing its (disabled) instance saves each web request's thread from building
# one again (Celery keeps a backend per thread, and finding its class reads every package's entry points).
CELERY_RESULT_BACKEND_THREAD_SAFE = True
# Tasks are acknowledged on receipt. A lost task is found by its turn instead (a dead node's turns are
# sent again by its peers, a turn queued too long by its idle node). Late acks would also crash the worker
# when Redis restarts: kombu then restores unacked messages over a connection already gone.
CELERY_TASK_ACKS_LATE = False
# So kombu keeps no copy of each delivered message in Redis until its ack (`ack_emulation`): a lost task is
# found by its turn, as above. The copy cost the node's consumer a transaction on receipt and another on the
# ack, about half its CPU a message (1.9 against 0.95 ms, a scratch worker here); a clean shutdown still puts
# back what was prefetched and not started.
CELERY_BROKER_TRANSPORT_OPTIONS = {"ack_emulation": False}
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
NODE_QUEUE_PREFIX = "node."

# Inference nodes. The engine reads its own knobs from the environment
# (inference.config.EngineConfig); these are the ones the web side needs too.
NODE_NAME = env.str("NODE_NAME", default="local")

# Router: nodes register and heartbeat themselves; sessions stick to their node.
ROUTER_HEARTBEAT_SECONDS = env.float("ROUTER_HEARTBEAT_SECONDS", default=2.0)
ROUTER_NODE_TIMEOUT_SECONDS = env.float("ROUTER_NODE_TIMEOUT_SECONDS", default=10.0)
# A node's load is kept every this many seconds, for this many hours: its admin page charts it.
ROUTER_NODE_SAMPLE_SECONDS = env.float("ROUTER_NODE_SAMPLE_SECONDS", default=10.0)
ROUTER_NODE_HISTORY_HOURS = env.float("ROUTER_NODE_HISTORY_HOURS", default=24.0)
# How old a router's view of the nodes' loads may get before it reads them again (each decision checks
# the node it writes to is still healthy, whatever the view says).
ROUTER_VIEW_SECONDS = env.float("ROUTER_VIEW_SECONDS", default=1.0)
ROUTER_DEFAULT_POLICY = env.str("ROUTER_DEFAULT_POLICY", default="sticky")
ROUTER_POLICIES = {
    # Balances sessions, the engine's work and KV use (router.policies.LoadModel). Past 1.15x the mean
    # load, cold sessions move (to the least loaded of 3 nodes drawn); warm ones only past 2x. (1.25 let the
    # busiest node of bench_router's skewed replay serve over 1.3x the mean turns in 3 of 21 draws.)
    "sticky": {
        "BACKEND": "router.policies.StickyPolicy",
        "OPTIONS": {"load_factor": 1.15, "weights": {"sessions": 1, "work": 2, "kv": 1}, "warm_factor": 2.0},
    },
    # The policy before: sessions alone, any session moves past the bound.
    "sticky_sessions": {
        "BACKEND": "router.policies.StickyPolicy",
        "OPTIONS": {"load_factor": 1.25, "cold_moves": False},
    },
    "round_robin": {"BACKEND": "router.policies.RoundRobinPolicy"},
    "least_loaded": {"BACKEND": "router.policies.LeastLoadedPolicy"},
    "random": {"BACKEND": "router.policies.RandomPolicy"},
}
CHAT_MAX_MESSAGE_CHARS = env.int("CHAT_MAX_MESSAGE_CHARS", default=8000)
# Largest request body (an API client resends its whole history): 2 MiB; larger is refused with 413/400.
DATA_UPLOAD_MAX_MEMORY_SIZE = 2 * 2**20
CHAT_SYSTEM_PROMPT = env.str("CHAT_SYSTEM_PROMPT", default="")
# Memory assembly: how much of a conversation is resent each turn (chatapp/memory). Every alias is
# built at start-up (a system check); a conversation can switch alias at any time.
CHAT_DEFAULT_STRATEGY = env.str("CHAT_DEFAULT_STRATEGY", default="stable_prefix")
CHAT_MEMORY_STRATEGIES = {
    "full": {"BACKEND": "chatapp.memory.strategies.Full"},
    "window": {"BACKEND": "chatapp.memory.strategies.Window", "OPTIONS": {"exchanges": 6}},
    "token_budget": {"BACKEND": "chatapp.memory.strategies.TokenBudget", "OPTIONS": {"history_tokens": 1536}},
    "stable_prefix": {"BACKEND": "chatapp.memory.strategies.StablePrefix", "OPTIONS": {"high": 2560, "low": 1024}},
    "summary": {
        "BACKEND": "chatapp.memory.strategies.StablePrefix",
        "OPTIONS": {"high": 2560, "low": 1024, "summarize": True},
    },
    "retrieval": {
        "BACKEND": "chatapp.memory.strategies.TokenBudget",
        "OPTIONS": {"history_tokens": 1536, "retrieve": 4},
    },
    "pinned": {
        "BACKEND": "chatapp.memory.strategies.StablePrefix",
        "OPTIONS": {"high": 2560, "low": 1024, "pinned": True},
    },
    # Earlier sittings' turns recalled by BM25 in a block before each new message, which stays there in later
    # prompts (chatapp.memory.base); sizes as shares of the prompt's budget. `recall` gives the new block all
    # that a small window leaves (most evidence, most computed), `recall_cached` most of it to the window.
    "recall": {
        "BACKEND": "chatapp.memory.strategies.StablePrefix",
        "OPTIONS": {"high": 0.2, "low": 0.1, "recall_tokens": 1.0},
    },
    "recall_cached": {
        "BACKEND": "chatapp.memory.strategies.StablePrefix",
        "OPTIONS": {"high": 0.8, "low": 0.3, "recall_tokens": 0.2},
    },
}
CHAT_STREAM_TTL_SECONDS = env.int("CHAT_STREAM_TTL_SECONDS", default=3600)
# How often a node sends a reply's new text to its stream (a reply's first text goes at once): the tokens
# of the steps in between go as one entry (`chatapp.stream_writer`). 0: every step's tokens at once.
CHAT_STREAM_INTERVAL_MS = env.int("CHAT_STREAM_INTERVAL_MS", default=100)
# Unfinished turns a node may hold per generation slot before new ones are refused ("busy, retry").
CHAT_QUEUE_PER_SLOT = env.int("CHAT_QUEUE_PER_SLOT", default=4)
# A turn queued this long on an idle node lost its Celery task (a broker restart) and is sent again.
CHAT_LOST_TURN_SECONDS = env.float("CHAT_LOST_TURN_SECONDS", default=20.0)
# The model new conversations get (the API's `model` field and the chat page pick others); each node
# serves one model, and a model is offered while some node serves it. Empty: the packaged default.
CHAT_DEFAULT_MODEL = env.str("CHAT_DEFAULT_MODEL", default="") or DEFAULT_MODEL
# How long an API request waits for its reply before giving up (and cancelling it).
CHAT_API_TIMEOUT_SECONDS = env.int("CHAT_API_TIMEOUT_SECONDS", default=600)
# How long a browser's event stream waits on Redis between entries (a keep-alive is sent in between).
CHAT_SSE_BLOCK_MS = env.int("CHAT_SSE_BLOCK_MS", default=15_000)
# A turn whose node is gone is sent to another node; with none up for this long it fails, saying so.
CHAT_ORPHAN_SECONDS = env.float("CHAT_ORPHAN_SECONDS", default=60.0)
# Fair use, per user (all of a user's API keys and browser tabs together), shared by every web process.
CHAT_USER_MAX_RUNNING_TURNS = env.int("CHAT_USER_MAX_RUNNING_TURNS", default=4)  # unfinished turns at once
CHAT_USER_TOKENS_PER_MINUTE = env.int("CHAT_USER_TOKENS_PER_MINUTE", default=200_000)  # prompt + reply tokens
# The same per API key: a user may give a script's key less than the whole account.
CHAT_KEY_MAX_RUNNING_TURNS = env.int("CHAT_KEY_MAX_RUNNING_TURNS", default=4)
CHAT_KEY_TOKENS_PER_MINUTE = env.int("CHAT_KEY_TOKENS_PER_MINUTE", default=200_000)
CHAT_USER_MAX_CONVERSATIONS = env.int("CHAT_USER_MAX_CONVERSATIONS", default=10_000)
CHAT_USER_MAX_FACTS = env.int("CHAT_USER_MAX_FACTS", default=200)
CHAT_MAX_PINS_PER_CONVERSATION = env.int("CHAT_MAX_PINS_PER_CONVERSATION", default=20)

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": env.str("LOG_LEVEL", default="INFO")},
}
