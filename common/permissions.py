"""Operator permissions, checked in one place: ``may(user, permission)``, for the API and the admin alike."""

from rest_framework import permissions

# Methods that only describe or read what another method of the same view serves.
_READ_ALIASES = {"HEAD": "GET"}


def may(user, permission):
    """Return whether ``user`` is an active, signed-in user holding ``permission`` (superusers hold every one)."""
    return bool(
        user is not None
        and getattr(user, "is_authenticated", False)
        and getattr(user, "is_active", False)
        and user.has_perm(permission)
    )


def view_permissions(view, method):
    """Return the permissions of which ``view`` needs one for ``method`` (empty: the method is not declared).

    ``view.operator_permissions`` maps each HTTP method the view serves to its one permission; HEAD
    needs GET's, and OPTIONS (a description of the endpoint) any of the view's.
    """
    declared = getattr(view, "operator_permissions", {})
    if method == "OPTIONS":
        return tuple(sorted(set(declared.values())))
    permission = declared.get(_READ_ALIASES.get(method, method))
    return (permission,) if permission else ()


class OperatorPermission(permissions.BasePermission):
    """The API's one permission check: the caller must hold the permission its view declares for the method.

    A refusal is a 403 ``permission_denied`` naming the permission (401 for a caller not signed in). A
    method the view serves without declaring a permission is refused to everyone, so a new endpoint is
    closed until it says what it needs; one it does not serve is left to answer 405.
    """

    def has_permission(self, request, view):
        needed = view_permissions(view, request.method)
        if not needed:
            served = hasattr(view, request.method.lower()) and request.method not in ("OPTIONS",)
            self.message = f"{request.method} {request.path} declares no permission"
            return bool(request.user and request.user.is_authenticated) and not served
        self.message = f"You need the {' or '.join(needed)} permission"
        return any(may(request.user, permission) for permission in needed)
