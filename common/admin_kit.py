"""Helpers every app's admin uses: status badges, live ages, live list rows, object buttons, form pages."""

import json

from django import forms
from django.contrib import messages
from django.contrib.admin.utils import quote, unquote
from django.core.exceptions import PermissionDenied
from django.core.paginator import Paginator
from django.db import connections
from django.http import JsonResponse
from django.shortcuts import redirect
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils import timezone
from django.utils.functional import cached_property
from django.utils.html import conditional_escape, format_html

from .errors import ServiceError
from .humanize import ago
from .inputs import json_problem, limit, text_problem
from .permissions import may

LIVE_ROWS_MAX = 500
# Above this many rows (PostgreSQL's estimate), an unfiltered list shows the estimate, not an exact count.
ESTIMATE_COUNT_ABOVE = 100_000


# --- shared display helpers -------------------------------------------------------------------------


def ago_html(moment):
    """Return an age that ``live.js`` keeps ticking in the browser, with the exact time on hover."""
    if moment is None:
        return format_html('<span class="st-muted">{}</span>', "never")
    local = timezone.localtime(moment)
    return format_html(
        '<time datetime="{}" data-ago title="{}">{}</time>', moment.isoformat(), f"{local:%Y-%m-%d %H:%M:%S %Z}", ago(moment)
    )


def status_badge(status, label=None, *, note=""):
    """Return a coloured status pill (colours in ``static/simpletuner/admin/admin.css``)."""
    return format_html(
        '<span class="st-badge st-{}" data-status="{}">{}</span>{}',
        status,
        status,
        label or status,
        format_html(' <span class="st-muted">{}</span>', note) if note else "",
    )


def admin_link(obj, text=None):
    """Return a link to ``obj``'s admin page."""
    opts = obj._meta
    url = reverse(f"admin:{opts.app_label}_{opts.model_name}_change", args=[quote(obj.pk)])
    return format_html('<a href="{}">{}</a>', url, text or str(obj))


class EstimatedCountPaginator(Paginator):
    """Counts exactly, except an unfiltered list of a large table on PostgreSQL: ``pg_class.reltuples``.

    For the tables that only grow (jobs, the audit trail), whose list would otherwise count every row
    on every page.
    """

    @cached_property
    def count(self):
        queryset = self.object_list
        connection = connections[queryset.db]
        if connection.vendor == "postgresql" and not queryset.query.where:
            with connection.cursor() as cursor:
                cursor.execute(
                    "SELECT reltuples::bigint FROM pg_class WHERE oid = %s::regclass", [queryset.model._meta.db_table]
                )
                row = cursor.fetchone()
            if row and row[0] > ESTIMATE_COUNT_ABOVE:
                return row[0]
        return super().count


# --- live list pages --------------------------------------------------------------------------------


class LiveChangeListMixin:
    """For a ModelAdmin: ``live_fields`` (display-method names in ``list_display``) refresh in place.

    Adds ``<changelist>/live/?ids=a,b`` answering ``{"rows": {pk: {field: html}}, "missing": [...]}``;
    with ``&detail=1`` the cells of ``live_detail_fields`` too, which the object's own page refreshes.
    """

    live_fields = ()
    live_detail_fields = ()
    change_list_template = "admin/simpletuner/live_change_list.html"  # tells live.js where rows refresh from

    def get_urls(self):
        info = self.opts.app_label, self.opts.model_name
        live = path("live/", self.admin_site.admin_view(self.live_rows_view), name="%s_%s_live" % info)
        return [live, *super().get_urls()]

    def change_view(self, request, object_id, form_url="", extra_context=None):
        info = self.opts.app_label, self.opts.model_name
        live = {"live_object_url": reverse("admin:%s_%s_live" % info), "live_object_id": unquote(object_id)}
        return super().change_view(request, object_id, form_url, {**live, **(extra_context or {})})

    def live_rows_view(self, request):
        """Return the live cells of the rows whose primary keys ``?ids=`` lists (at most 500)."""
        if not self.has_view_or_change_permission(request):
            raise PermissionDenied
        ids = [pk for pk in request.GET.get("ids", "").split(",") if pk and not text_problem(pk)][:LIVE_ROWS_MAX]
        fields = (*self.live_fields, *self.live_detail_fields) if request.GET.get("detail") else self.live_fields
        queryset = self.get_queryset(request).filter(pk__in=ids)
        if self.list_select_related:  # as the list page does, or one query per row for its links
            queryset = queryset.select_related(*(() if self.list_select_related is True else self.list_select_related))
        rows = {
            # Escaped as the list page escapes them: a plain string (a GPU name an agent reported) is text, not HTML.
            str(obj.pk): {name: str(conditional_escape(getattr(self, name)(obj))) for name in fields}
            for obj in queryset
        }
        return JsonResponse({"rows": rows, "missing": sorted(set(ids) - set(rows)), "now": timezone.now().isoformat()})


class OperatorPermissionsMixin:
    """For a ModelAdmin: ``operator_permissions`` maps each of its actions to the one permission it needs.

    ``view``, ``add`` and ``delete`` answer Django's own checks; the others (``drain``, ``cancel``...)
    are asked as ``has_<action>_permission(request)`` by list actions (``permissions=[...]``) and
    object buttons. All of them by ``common.permissions.may``, the check the API makes. Nothing is
    changed through a form: every change is one of these actions.
    """

    operator_permissions = {}

    def may(self, request, action):
        """Return whether the user making ``request`` holds the permission of ``action``."""
        permission = self.operator_permissions.get(action)
        return permission is not None and may(request.user, permission)

    def has_view_permission(self, request, obj=None):
        return self.may(request, "view")

    def has_add_permission(self, request):
        return self.may(request, "add")

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return self.may(request, "delete")


class ObjectButtonsMixin:
    """For a ModelAdmin: detail-page buttons, each a POST-only view at ``<object_id>/<name>/``.

    ``object_buttons`` names them; ``<name>_view(request, pk)`` gets the id already unquoted, and runs
    only for a POST by a user with ``has_<name>_permission(request)``. URL names are
    ``<app>_<model>_<name>``.
    """

    object_buttons = ()

    def get_urls(self):
        info = self.opts.app_label, self.opts.model_name
        buttons = [
            path(f"<str:object_id>/{name}/", self.admin_site.admin_view(self._button_view(name)), name="%s_%s_" % info + name)
            for name in self.object_buttons
        ]
        return [*buttons, *super().get_urls()]

    def _button_view(self, name):
        view = getattr(self, f"{name}_view")
        allowed = getattr(self, f"has_{name}_permission")

        def posted(request, object_id):
            if request.method != "POST" or not allowed(request):
                raise PermissionDenied
            return view(request, unquote(object_id))

        return posted

    def change_page(self, pk):
        """Redirect to the admin page of the object ``pk``."""
        info = self.opts.app_label, self.opts.model_name
        return redirect(reverse("admin:%s_%s_change" % info, args=[quote(pk)]))


# --- helpers for the apps' admins ---------------------------------------------------------------------


def run_service_on_each(modeladmin, request, objects, call, *, done):
    """Call ``call(obj)`` for each object; report the successes as ``done`` and each refusal by its reason.

    Every admin action goes through the same services as the API, so the audit rows and events match.
    """
    succeeded = []
    for obj in objects:
        try:
            call(obj)
        except ServiceError as exc:
            modeladmin.message_user(request, f"Refused: {exc.detail}", messages.ERROR)
        else:
            succeeded.append(str(getattr(obj, "name", None) or obj.pk))
    if succeeded:
        modeladmin.message_user(request, f"{done}: {', '.join(succeeded)}", messages.SUCCESS)
    return succeeded


# --- Django's usual intermediate confirmation page, for every action that changes something ------------


def confirmed(request):
    """Return whether ``request`` is the operator's "Yes" on the confirmation page (Django's ``post=yes``)."""
    return request.method == "POST" and request.POST.get("post") == "yes"


def confirmation_page(
    modeladmin, request, *, title, question, rows, confirm_label, back_url, action=None, objects=(), refused=(), hidden=()
):
    """Render the intermediate page that lists what an action will change before it runs.

    ``rows``: ``(object, [what changes, ...])`` for each object the action will change; ``refused``:
    ``(object, why)`` for each it will leave as it is. Its "Yes" re-posts the request with ``post=yes``
    (and, for a list ``action``, the ``objects`` as ``_selected_action``) plus the ``hidden`` pairs.
    """
    context = {
        **modeladmin.admin_site.each_context(request),
        "title": title,
        "question": question,
        "rows": rows,
        "refused": refused,
        "confirm_label": confirm_label,
        "back_url": back_url,
        "action": action,
        "objects": objects,
        "hidden": hidden,
        "opts": modeladmin.opts,
    }
    return TemplateResponse(request, "admin/simpletuner/confirm_action.html", context)


def changelist_url(modeladmin):
    """Return the URL of ``modeladmin``'s list page."""
    return reverse("admin:%s_%s_changelist" % (modeladmin.opts.app_label, modeladmin.opts.model_name))


def pretty_json_html(value):
    """Return ``value`` as indented JSON in a ``<pre>``."""
    return format_html("<pre>{}</pre>", json.dumps(value, indent=2, sort_keys=True, default=str))


def form_page(modeladmin, request, form, *, title, intro, form_id, submit_label):
    """Render an admin page holding one form (the Add worker and Submit job pages)."""
    context = {
        **modeladmin.admin_site.each_context(request),
        "title": title,
        "intro": intro,
        "form_id": form_id,
        "submit_label": submit_label,
        "opts": modeladmin.opts,
        "form": form,
        "media": modeladmin.media + form.media,
    }
    return TemplateResponse(request, "admin/simpletuner/form_page.html", context)


class JSONFormField(forms.JSONField):
    """A form's JSON field that refuses JSON nested too deep for the decoder as invalid input, not a crash, and
    shows JSON the API would refuse (``json_problem``: an unpaired surrogate cannot even be rendered) again as typed."""

    def to_python(self, value):
        try:
            return super().to_python(value)
        except RecursionError:
            raise forms.ValidationError(f"JSON nested deeper than {limit('MAX_JSON_DEPTH')} levels") from None

    def bound_data(self, data, initial):
        try:
            value = super().bound_data(data, initial)
        except RecursionError:
            return forms.fields.InvalidJSONInput(data)
        if data is not None and not isinstance(value, forms.fields.InvalidJSONInput) and json_problem(value):
            return forms.fields.InvalidJSONInput(data)
        return value


class ReadOnlyAdminMixin:
    """An admin page for records that change only through their services: no add, change or delete page."""

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False
