"""One login limiter for every path: the login page and the admin, usernames normalised as Django does,
and parallel attempts counted atomically (against the real web process)."""

import http.cookiejar
import re
import threading
import urllib.parse
import urllib.request

import pytest
from django.urls import reverse

from chatapp import streams
from tests.factories import UserFactory

PASSWORD = "correct horse battery staple"
WRONG = "Please enter a correct username and password"


@pytest.fixture(autouse=True)
def no_earlier_attempts():
    def clear():
        redis = streams.client()
        for key in redis.scan_iter("login-attempts:*"):
            redis.delete(key)

    clear()
    yield
    clear()


def login(client, username: str, password: str, *, path: str = "login") -> str:
    url = reverse(path) if path == "login" else "/admin/login/"
    return client.post(url, {"username": username, "password": password}).content.decode()


def test_repeated_failed_logins_lock_the_account_for_a_while(client, user):
    for _ in range(5):
        assert WRONG in login(client, user.username, "wrong")
    assert "Too many failed logins" in login(client, user.username, PASSWORD)
    assert "_auth_user_id" not in client.session
    streams.client().delete(f"login-attempts:user:{user.username}")
    response = client.post(reverse("login"), {"username": user.username, "password": PASSWORD})
    assert response.status_code == 302


def test_the_admin_login_goes_through_the_same_limiter(client, db):
    staff = UserFactory.create(is_staff=True, is_superuser=True)
    for _ in range(5):
        assert "correct username and password" in login(client, staff.username, "wrong", path="admin")
    assert "Too many failed logins" in login(client, staff.username, PASSWORD, path="admin")
    assert "Too many failed logins" in login(client, staff.username, PASSWORD)  # and on the other page
    assert "_auth_user_id" not in client.session


def test_a_username_spelled_with_compatibility_characters_counts_against_the_same_account(client, db):
    user = UserFactory.create(username="demo-nfkc")
    fullwidth = "\uff44emo-nfkc"  # a fullwidth d: Django's form normalises it (NFKC) to "demo-nfkc"
    for variant in [fullwidth, "DEMO-nfkc", fullwidth, "Demo-NFKC", fullwidth]:
        assert WRONG in login(client, variant, "wrong")
    assert "Too many failed logins" in login(client, user.username, PASSWORD)


def test_parallel_attempts_cannot_all_slip_under_the_limit(asgi_server, db):
    """Twenty wrong passwords at once, on the real web process: only the first five are even checked."""
    user = UserFactory.create()
    jar = http.cookiejar.CookieJar()
    opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
    page = opener.open(f"{asgi_server}/login/").read().decode()
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page)[1]  # type: ignore[index]
    body = urllib.parse.urlencode({"username": user.username, "password": "wrong", "csrfmiddlewaretoken": token})
    answers: list[str] = []
    start = threading.Barrier(20)

    def attempt() -> None:
        start.wait()
        answers.append(opener.open(f"{asgi_server}/login/", data=body.encode()).read().decode())

    threads = [threading.Thread(target=attempt) for _ in range(20)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert len(answers) == 20
    assert sum(WRONG in a for a in answers) == 5
    assert sum("Too many failed logins" in a for a in answers) == 15
