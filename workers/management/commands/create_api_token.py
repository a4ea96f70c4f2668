"""Create (optionally) a user and print a new operator API token on the last line of stdout."""

from datetime import timedelta

from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.core.management.base import BaseCommand, CommandError
from django.utils import timezone

from audit.services import audited_atomic
from workers.accounts import acting_as
from workers.services import api_token_create

from ._workers import command_actor, service_errors

SHIPPED_GROUPS = ("viewer", "operator", "admin")  # made by simpletuner_site's groups migration


class Command(BaseCommand):
    help = "Issue an operator API token (Authorization: Bearer ...) for USERNAME; the token is printed once."

    def add_arguments(self, parser):
        parser.add_argument("username")
        parser.add_argument("--superuser", action="store_true", help="create the user as a superuser if missing")
        parser.add_argument(
            "--group", choices=SHIPPED_GROUPS, default=None,
            help="create the user in this shipped group if missing (viewer, operator, admin; see docs/api.md)",
        )
        parser.add_argument("--description", default="", help="what the token is for")
        parser.add_argument(
            "--expires-in", type=float, metavar="DAYS", default=None, help="refuse the token after DAYS days (default: never)"
        )

    def handle(self, username, superuser, description, expires_in=None, group=None, **options):
        if superuser and group:
            raise CommandError("pass --superuser or --group, not both")
        User = get_user_model()
        actor = command_actor("create_api_token")
        with audited_atomic(), acting_as(actor):  # a user it creates is audited as this command's
            user = User.objects.filter(username=username).first()
            if user is None and group:
                shipped = Group.objects.filter(name=group).first()
                if shipped is None:
                    raise CommandError(f"group {group!r} is missing; run `manage.py migrate`, which creates it")
                user = User.objects.create_user(username=username, email="", password=None)
                user.groups.add(shipped)
                self.stderr.write(f"Created user {username!r} in group {group!r} (no password)")
            elif user is None:
                if not superuser:
                    raise CommandError(
                        f"user {username!r} does not exist; pass --superuser to create it as an administrator"
                        " (or --group GROUP to create it in a shipped group)"
                    )
                user = User.objects.create_superuser(username=username, email="", password=None)
                self.stderr.write(f"Created superuser {username!r} (no password; set one with `manage.py changepassword {username}`)")
            elif group and not user.groups.filter(name=group).exists():
                raise CommandError(f"user {username!r} exists and is not in group {group!r}; refusing to change its groups")
            elif superuser and not user.is_superuser:
                raise CommandError(f"user {username!r} exists and is not a superuser; refusing to promote it")
            expires_at = timezone.now() + timedelta(days=expires_in) if expires_in is not None else None
            with service_errors():
                token = api_token_create(
                    user=user, actor=actor, description=description, expires_at=expires_at
                )
        self.stderr.write("API token (shown once; use it as: Authorization: Bearer <token>):")
        self.stdout.write(token)
