"""The Tokens page: every token by its prefix; operators create their API tokens (shown once, with an
expiry) and revoke them, each through ``workers.services`` (audited like the API and manage.py)."""

from datetime import timedelta

from django import forms
from django.contrib import admin, messages
from django.contrib.auth import get_user_model
from django.core.exceptions import PermissionDenied
from django.template.response import TemplateResponse
from django.utils import timezone

from audit.services import Actor
from common.admin_kit import (
    OperatorPermissionsMixin,
    changelist_url,
    confirmation_page,
    confirmed,
    form_page,
    status_badge,
)
from common.errors import ServiceError

from . import permissions
from .models import Token, TokenKind
from .services import api_token_create, api_tokens_revoke

# Expiry choices (days; "" = never); a custom date is possible too.
EXPIRY_CHOICES = [("30", "in 30 days"), ("7", "in 7 days"), ("1", "in 1 day"), ("90", "in 90 days"), ("365", "in 1 year"), ("", "never"), ("date", "on a date…")]


class ApiTokenForm(forms.Form):
    user = forms.ModelChoiceField(queryset=get_user_model().objects.none(), help_text="Whose token: it acts with that user's permissions.")
    description = forms.CharField(max_length=200, required=False, help_text="What it is for (e.g. CI, Prometheus).")
    expires = forms.ChoiceField(choices=EXPIRY_CHOICES, initial="30", widget=forms.RadioSelect, help_text="After it, the token is refused.")
    expires_on = forms.DateTimeField(required=False, label="Expires on", help_text="With “on a date…”: YYYY-MM-DD HH:MM (server time).")

    def __init__(self, *args, request, **kwargs):
        super().__init__(*args, **kwargs)
        users = get_user_model().objects.filter(is_active=True).order_by("username")
        # A token acts as its user: an operator issues tokens for their own account; a superuser for anyone.
        self.fields["user"].queryset = users if request.user.is_superuser else users.filter(pk=request.user.pk)
        self.fields["user"].initial = request.user.pk

    def clean(self):
        data = super().clean()
        choice = data.get("expires")
        if choice == "date":
            if not data.get("expires_on"):
                self.add_error("expires_on", "Give the date, or choose another expiry.")
            data["expires_at"] = data.get("expires_on")
        else:
            data["expires_at"] = timezone.now() + timedelta(days=int(choice)) if choice else None
        return data


@admin.register(Token)
class TokenAdmin(OperatorPermissionsMixin, admin.ModelAdmin):
    list_display = ["prefix", "kind", "worker", "user", "description", "state_display", "created_at", "last_used_at", "expires_at"]
    list_filter = ["kind"]
    readonly_fields = ["kind", "prefix", "worker", "user", "description", "created_at", "last_used_at", "expires_at", "revoked_at"]
    exclude = ["digest"]
    actions = ["revoke_api_tokens"]
    # Add: an operator API token (a worker's comes with its worker). No delete: rotate a worker's
    # token instead (audited, and it closes the streams opened with it); revoke an operator's.
    operator_permissions = {
        "view": permissions.VIEW_TOKENS,
        "add": permissions.MANAGE_API_TOKENS,
        "revoke": permissions.MANAGE_API_TOKENS,
    }

    def has_revoke_permission(self, request):
        return self.may(request, "revoke")

    def get_actions(self, request):
        actions = super().get_actions(request)
        actions.pop("delete_selected", None)
        return actions

    @admin.display(description="State")
    def state_display(self, token):
        state = token.state(timezone.now())
        return status_badge({"active": "idle", "expired": "failed", "revoked": "cancelled"}[state], state)

    # --- create: the token is shown once ----------------------------------------------------------

    def add_view(self, request, form_url="", extra_context=None):
        if not self.has_add_permission(request):
            raise PermissionDenied
        form = ApiTokenForm(request.POST or None, request=request)
        if request.method == "POST" and form.is_valid():
            data = form.cleaned_data
            try:
                plaintext = api_token_create(
                    user=data["user"], actor=Actor.for_request(request), description=data["description"], expires_at=data["expires_at"]
                )
            except ServiceError as exc:
                form.add_error(None, exc.detail)
            else:
                return self._shown_once(request, data["user"], plaintext, data["expires_at"])
        return form_page(
            self,
            request,
            form,
            title="Create an operator API token",
            intro="The token acts with its user's permissions (Authorization: Bearer …). It is shown once, on the next page; "
            "only its hash is kept.",
            form_id="api_token_form",
            submit_label="Create token",
        )

    def _shown_once(self, request, user, plaintext, expires_at):
        context = {
            **self.admin_site.each_context(request),
            "title": f"API token for {user.get_username()}",
            "opts": self.opts,
            "token": plaintext,
            "owner": user.get_username(),
            "expires_at": expires_at,
            "base_url": request.build_absolute_uri("/").rstrip("/"),
        }
        response = TemplateResponse(request, "admin/workers/token/token_once.html", context)
        response["Cache-Control"] = "no-store"
        return response

    # --- revoke ------------------------------------------------------------------------------------

    @admin.action(description="Revoke selected operator API tokens", permissions=["revoke"])
    def revoke_api_tokens(self, request, queryset):
        if queryset.filter(kind=TokenKind.WORKER).exists():
            self.message_user(
                request, "Refused: worker tokens are rotated from their worker's page, not revoked here.", messages.ERROR
            )
            return None
        tokens = list(queryset.select_related("user"))
        if not confirmed(request):
            return confirmation_page(
                self,
                request,
                title="Revoke API tokens",
                question="Revoke these operator API tokens? A revoked token is refused at once, for good.",
                rows=[(f"{t.prefix}… ({t.user})", [f"refused from now on ({t.description or 'no description'})"]) for t in tokens if t.is_active],
                refused=[(f"{t.prefix}… ({t.user})", "already revoked") for t in tokens if not t.is_active],
                confirm_label="Yes, revoke them",
                back_url=changelist_url(self),
                action="revoke_api_tokens",
                objects=[t for t in tokens if t.is_active],
            )
        revoked = api_tokens_revoke(token_ids=[t.pk for t in tokens], actor=Actor.for_request(request))
        if revoked:
            self.message_user(
                request, f"Revoked {len(revoked)} API token(s): {', '.join(t.prefix for t in revoked)}", messages.SUCCESS
            )
        else:
            self.message_user(request, "Nothing to revoke: those tokens were revoked already.", messages.INFO)
        return None

