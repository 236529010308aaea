"""Who is exempt from the turn limits: the one-query check agrees with Django's `has_perm` in every case."""

from django.contrib.auth.models import Group, Permission, User
from django.db import connection, transaction

from chatapp import quotas


def test_unlimited_use_is_answered_as_has_perm_answers_it(db):
    permission = Permission.objects.get(codename="unlimited_use", content_type__app_label="chatapp")
    users = [User.objects.create_user(f"quota-{n}") for n in range(6)]
    _plain, direct, through_group, superuser, inactive_superuser, other_permissions = users
    direct.user_permissions.add(permission)
    unrelated = Permission.objects.get(codename="add_conversation", content_type__app_label="chatapp")
    other_permissions.user_permissions.add(unrelated)
    Group.objects.create(name="editors").permissions.add(unrelated)
    other_permissions.groups.add(Group.objects.get(name="editors"))
    group = Group.objects.create(name="replay accounts")
    group.permissions.add(permission)
    through_group.groups.add(group)
    superuser.is_superuser = True
    superuser.save(update_fields=["is_superuser"])
    inactive_superuser.is_superuser, inactive_superuser.is_active = True, False
    inactive_superuser.save(update_fields=["is_superuser", "is_active"])

    answers = [quotas._unlimited_else_locked(u.pk) for u in users]
    assert answers == [False, True, True, True, False, False]
    assert answers == [User.objects.get(pk=u.pk).has_perm(quotas.UNLIMITED) for u in users]


def test_the_users_lock_is_taken_unless_the_account_is_exempt(db):
    """In the same round trip: an exempt account takes no lock, any other holds its lock until commit."""
    plain, exempt = User.objects.create_user("locked"), User.objects.create_user("exempt")
    quotas.grant_unlimited_use(exempt)

    def advisory_locks_held() -> int:
        with connection.cursor() as cursor:
            cursor.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()")
            return cursor.fetchone()[0]

    with transaction.atomic():
        assert quotas._unlimited_else_locked(exempt.pk) and advisory_locks_held() == 0
        assert not quotas._unlimited_else_locked(plain.pk) and advisory_locks_held() == 1
