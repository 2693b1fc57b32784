"""``{% connected_applications %}``: the OAuth section of the settings page
(docs/mcp.md#oauth-connected-applications), rendered from the ``oauth`` app so that
``core``'s settings view needs no import of it (``core`` is the kernel)."""

from __future__ import annotations

from typing import Any

from django import template

from oauth.selectors import settings_context

register = template.Library()


@register.inclusion_tag("oauth/connected_applications.html", takes_context=True)
def connected_applications(context: template.Context) -> dict[str, Any]:
    """The signed-in user's connected applications; for staff also every user's and the
    ``OAuthPolicy`` switches. Needs ``request`` in the context (the request context processor)."""
    request = context["request"]
    return {"request": request, **settings_context(user=request.user)}
