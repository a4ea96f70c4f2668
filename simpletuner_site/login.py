"""The sign-in pages (the admin's and the browsable API's): failed sign-ins throttled before the password is hashed.

Both pages are Django's ``LoginView`` with a form that asks ``workers.throttling.login_refused`` first:
past the rate of failed sign-ins of the client's address or of the username, the password is not
checked (a PBKDF2 hash costs ~0.2 s of a request thread) and the page answers 429 with ``Retry-After``
and a form error. Each failure is counted and audited (bounded) by ``workers.receivers`` from Django's
``user_login_failed``, each success audited from ``user_logged_in``.
"""

from django import forms
from django.contrib.admin.forms import AdminAuthenticationForm
from django.contrib.auth.forms import AuthenticationForm
from django.contrib.auth.views import LoginView, LogoutView
from django.template.response import TemplateResponse
from django.urls import path

from workers.throttling import login_refused

THROTTLED = "throttled"


class ThrottledLoginMixin:
    """An authentication form that refuses a sign-in without checking its password once its address or username
    is past the rate of failed sign-ins; ``retry_after`` is then the seconds to wait."""

    retry_after = None

    def clean(self):
        username, password = self.cleaned_data.get("username"), self.cleaned_data.get("password")
        if username is not None and password:
            self.retry_after = login_refused(self.request, username)
            if self.retry_after is not None:
                raise forms.ValidationError(
                    "Too many failed sign-ins from this address or for this username: try again in %(seconds)d seconds.",
                    code=THROTTLED,
                    params={"seconds": self.retry_after},
                )
        return super().clean()


class LoginForm(ThrottledLoginMixin, AuthenticationForm):
    """The browsable API's sign-in form."""


class AdminLoginForm(ThrottledLoginMixin, AdminAuthenticationForm):
    """The admin's sign-in form (staff accounts only)."""


def throttled_answer(response):
    """Return ``response`` (a login page) as 429 with ``Retry-After`` when its form was refused by the throttle."""
    form = response.context_data.get("form") if isinstance(response, TemplateResponse) and response.context_data else None
    wait = getattr(form, "retry_after", None)
    if wait is not None:
        response.status_code = 429
        response["Retry-After"] = str(wait)
    return response


class ApiLoginView(LoginView):
    """``/api-auth/login/``: DRF's sign-in page with the throttled form."""

    authentication_form = LoginForm
    template_name = "rest_framework/login.html"

    def form_invalid(self, form):
        return throttled_answer(super().form_invalid(form))


# What ``rest_framework.urls`` routes (mounted at /api-auth/ in its ``rest_framework`` namespace), with our sign-in page.
API_AUTH_URLS = [
    path("login/", ApiLoginView.as_view(), name="login"),
    path("logout/", LogoutView.as_view(), name="logout"),
]
