"""What a browser finds at the site's root: a landing page linking the admin, the API and its docs; a favicon."""

from django.http import HttpResponse
from django.shortcuts import render
from django.views.decorators.cache import cache_control
from django.views.decorators.http import require_GET

# A small GPU-board mark (no file to serve, no external request).
FAVICON_SVG = (
    '<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 16 16">'
    '<rect x="1" y="3" width="14" height="10" rx="2" fill="#417690"/>'
    '<rect x="4" y="6" width="8" height="4" fill="#f5dd5d"/></svg>'
)


@require_GET
def landing(request):
    """GET /: where to go from here (the admin, the API, its docs, metrics), for a person who opened the bare address."""
    return render(request, "simpletuner/landing.html", {"signed_in": request.user.is_authenticated})


@require_GET
@cache_control(max_age=86400, public=True)
def favicon(request):
    """GET /favicon.ico: an SVG icon, so browsers stop asking (and the log stops recording 404s)."""
    return HttpResponse(FAVICON_SVG, content_type="image/svg+xml")
