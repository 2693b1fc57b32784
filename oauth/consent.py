"""The consent page of ``/oauth/authorize/`` (docs/mcp.md#oauth-consent).

django-oauth-toolkit's ``AuthorizationView`` does the protocol (RFC 6749 §4.1.1, PKCE, the
code, RFC 9207 ``iss``); this page decides what the user sees and what the code grants:

- who asks: the client's ``client_name``, marked unverified (anyone registering by DCR or
  publishing a metadata document may claim any name), the host of a metadata document's
  ``client_id`` URL, and — prominent — the host:port of the ``redirect_uri``, where the code goes;
- what it gets, in Dispatch's scopes (``oauth.scopes``): one checkbox per scope, the requested
  ones checked. A user may grant less than the client asked for (``mcp`` asked: any of the
  narrow scopes instead), never more; the code carries ``oauth.scopes.granted(checked)``.
  Allow with nothing checked is an error on the page, nothing is issued.

Errors found before a redirect is safe (unknown client, unregistered redirect URI, a
``resource`` this server issues no tokens for, RFC 8707 ``invalid_target``) render
``oauth/error.html`` and never redirect. The page may not be framed (clickjacking of Allow).
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from django import forms
from django.conf import settings
from django.http import HttpRequest, HttpResponse, HttpResponseBase
from django.http.response import HttpResponseRedirectBase
from django.utils.decorators import method_decorator
from django.views.decorators.cache import never_cache
from oauth2_provider.exceptions import OAuthToolkitError
from oauth2_provider.forms import AllowForm
from oauth2_provider.models import get_application_model
from oauth2_provider.settings import oauth2_settings
from oauth2_provider.views import AuthorizationView
from oauthlib.oauth2.rfc6749 import errors

from oauth.scopes import ALL, NARROW, granted
from oauth.validators import has_nul, redirect_uri_problem, resources

EVERYTHING = (
    "Everything: every MCP tool — your agents (launch, message, answer approvals), your remotes' "
    "functions, and your machines' files and commands"
)
FRAME_ANCESTORS = "frame-ancestors 'none'"


def offered_scopes(requested: list[str]) -> list[str]:
    """The scopes the user may tick for a request of ``requested`` (scope names): all of them
    when ``mcp`` was asked for (any narrower subset is less), else just the requested ones,
    in the page's order (``mcp`` first, then ``oauth.scopes.NARROW``)."""
    if ALL in requested:
        return [ALL, *NARROW]
    return [scope for scope in NARROW if scope in requested]


def scope_description(scope: str) -> str:
    """What ``scope`` lets a client do, in Dispatch's words (``OAUTH2_PROVIDER["SCOPES"]``)."""
    if scope == ALL:
        return EVERYTHING
    descriptions = oauth2_settings.SCOPES
    return str(descriptions.get(scope, scope))


def redirect_host(redirect_uri: str) -> str:
    """The ``host:port`` a ``redirect_uri`` sends the code to (the scheme's default port left
    out), e.g. ``"127.0.0.1:33418"``; for a native app's private-use scheme (RFC 8252 §7.1)
    the scheme and what follows it, e.g. ``"cursor://anysphere.cursor-mcp"``, since the
    scheme names the app; the URI itself when it does not parse."""
    try:
        parts = urlsplit(redirect_uri)
        host = parts.hostname or ""
        port = parts.port
    except ValueError:
        return redirect_uri
    if parts.scheme not in ("http", "https"):
        return f"{parts.scheme}://{parts.netloc}" if parts.netloc else redirect_uri
    if ":" in host:
        host = f"[{host}]"
    return f"{host}:{port}" if port else host or redirect_uri


PKCE_CHALLENGE = re.compile(r"[A-Za-z0-9_-]{43}")
"""An S256 ``code_challenge``: the base64url of a SHA-256, unpadded (RFC 7636 §4.2)."""


class ConsentForm(AllowForm):
    """DOT's hidden fields, plus ``scopes``: the boxes the user left checked. On Allow,
    ``clean`` replaces ``scope`` (the requested scopes, a hidden field) with the granted
    ones, which is what DOT's ``form_valid`` hands to the code; a scope outside what was
    requested (``offered_scopes``) or unknown, or none at all, is a form error."""

    scopes = forms.MultipleChoiceField(
        choices=[(scope, scope) for scope in (ALL, *NARROW)], required=False, widget=forms.CheckboxSelectMultiple
    )

    def clean(self) -> dict[str, Any]:
        cleaned = super().clean()
        requested = str(cleaned.get("scope") or "").split()
        cleaned["requested_scopes"] = requested
        if not cleaned.get("allow"):
            return cleaned  # a denial grants nothing, whatever is checked
        checked = list(cleaned.get("scopes") or [])
        offered = offered_scopes(requested)
        beyond = [scope for scope in checked if scope not in offered]
        if beyond:
            raise forms.ValidationError(
                f"{', '.join(beyond)} was not requested by this application: "
                "you can grant less than it asked for, not more."
            )
        if ALL in checked and len(checked) > 1:
            # "Everything" and a narrow box both checked: the user meant to narrow, or not.
            raise forms.ValidationError(
                "“Everything” is checked together with narrower permissions: uncheck “Everything” to give "
                "only what you checked, or uncheck the others to give everything."
            )
        if not checked:
            raise forms.ValidationError(
                "Check at least one permission to allow, or press Cancel to give this application nothing."
            )
        cleaned["scope"] = " ".join(granted(checked))
        return cleaned


@method_decorator(never_cache, name="dispatch")
class ConsentView(AuthorizationView):
    """``GET /oauth/authorize/``: the consent page (after Dispatch's login, ``/login/?next=…``);
    ``POST``: Allow (``allow=Authorize`` and the checked ``scopes``) redirects to the client's
    ``redirect_uri`` with a code (RFC 6749 §4.1.2), Cancel with ``error=access_denied``
    (RFC 6749 §4.1.2.1). ``approval_prompt=auto`` is ignored: the page shows every time, since scopes
    are picked on it (``REQUEST_APPROVAL_PROMPT`` is ``force``)."""

    template_name = "oauth/consent.html"
    error_template_name = "oauth/error.html"
    form_class = ConsentForm

    def dispatch(self, request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponseBase:
        response = super().dispatch(request, *args, **kwargs)
        # Allow must not be clickable through someone else's frame; X-Frame-Options for
        # browsers without CSP level 2.
        response["X-Frame-Options"] = "DENY"
        response["Content-Security-Policy"] = FRAME_ANCESTORS
        return response

    def get(self, request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        if "approval_prompt" in request.GET:
            query = request.GET.copy()
            query.pop("approval_prompt")
            request.GET = query  # type: ignore[assignment]
        unknown = [uri for uri in request.GET.getlist("resource") if uri not in resources()]
        if unknown:
            return self._error_page("invalid_target", _unknown_resource(unknown[0]))
        response: HttpResponse = super().get(request, *args, **kwargs)
        return response

    def validate_authorization_request(self, request: HttpRequest) -> tuple[list[str], dict[str, Any]]:
        """The library's checks, then PKCE's, before the page is shown: DOT shows it for
        ``plain`` (and refuses only once Allow is pressed) and for a challenge no S256
        verifier can match (issuing a code nobody can redeem). Such a request goes back to
        the client with ``invalid_request`` (RFC 6749 §4.1.2.1; RFC 7636 §4.4.1)."""
        scopes, credentials = super().validate_authorization_request(request)
        method, challenge = credentials.get("code_challenge_method"), credentials.get("code_challenge")
        problem = None
        if method != "S256":
            problem = "PKCE must use code_challenge_method=S256"
        elif not isinstance(challenge, str) or not PKCE_CHALLENGE.fullmatch(challenge):
            problem = "code_challenge must be an S256 challenge: 43 base64url characters"
        if problem is not None:
            error = errors.InvalidRequestError(description=problem, state=credentials.get("state"))
            raise OAuthToolkitError(error=error, redirect_uri=credentials.get("redirect_uri"))
        return scopes, credentials

    def form_valid(self, form: ConsentForm) -> HttpResponse:
        # DOT looks the client up with a bare .get() and, on Cancel, redirects to the posted
        # redirect_uri without checking it: both come from hidden fields, so check them here.
        application = self._application(str(form.cleaned_data.get("client_id") or ""))
        redirect_uri = str(form.cleaned_data.get("redirect_uri") or "")
        if application is None:
            return self._error_page("invalid_client_id", "This application is not registered on this server.")
        if redirect_uri_problem(redirect_uri) is not None or not application.redirect_uri_allowed(redirect_uri):
            return self._error_page("invalid_request", "The redirect URI is not registered for this application.")
        unknown = [uri for uri in str(form.cleaned_data.get("resource") or "").split() if uri not in resources()]
        if unknown:
            return self._error_page("invalid_target", _unknown_resource(unknown[0]))
        response: HttpResponse = super().form_valid(form)
        return response

    def form_invalid(self, form: ConsentForm) -> HttpResponse:
        application = self._application(str(form.data.get("client_id") or ""))
        if application is None:
            return self._error_page("invalid_client_id", "This application is not registered on this server.")
        context = self.get_context_data(
            form=form,
            application=application,
            redirect_uri=str(form.data.get("redirect_uri") or ""),
            scopes=str(form.data.get("scope") or "").split(),
            checked=form.data.getlist("scopes") if hasattr(form.data, "getlist") else [],
        )
        return self.render_to_response(context, status=400)

    def get_context_data(self, **kwargs: Any) -> dict[str, Any]:
        context: dict[str, Any] = super().get_context_data(**kwargs)
        application = context.get("application")
        if application is None or context.get("error"):
            return context
        requested = [str(scope) for scope in context.get("scopes") or []]
        offered = offered_scopes(requested)
        # The first showing checks what was asked, ``mcp`` alone when it was asked for;
        # a page shown again after an error keeps what the user checked.
        checked = context.get("checked")
        if checked is None:
            checked = [ALL] if ALL in requested else requested
        Application = get_application_model()
        source = application.registration_source
        client_id_host = ""
        if source == Application.RegistrationSource.CIMD:
            client_id_host = redirect_host(application.client_id)
        context.update(
            client_name=application.name,
            registration_source=source,
            registration_source_label=application.get_registration_source_display(),
            client_id_host=client_id_host,
            redirect_host=redirect_host(str(context.get("redirect_uri") or "")),
            requested_everything=ALL in requested,
            scope_choices=[
                {"name": scope, "description": scope_description(scope), "checked": scope in checked}
                for scope in offered
            ],
        )
        return context

    def render_to_response(self, context: dict[str, Any], **response_kwargs: Any) -> HttpResponse:
        if context.get("error"):
            # DOT renders its errors with ``template_name`` too: these get Dispatch's error page.
            response_kwargs.setdefault("status", 400)
            return self.response_class(
                request=self.request,
                template=[self.error_template_name],
                context=context,
                using=self.template_engine,
                **response_kwargs,
            )
        return super().render_to_response(context, **response_kwargs)

    def redirect(self, redirect_to: str, application: Any) -> HttpResponseRedirectBase:
        """DOT's redirect back to the client, with RFC 9207 ``iss`` on error responses too
        (Cancel's ``access_denied``; DOT adds it to codes only): RFC 9207 §2 puts it on every
        authorization response, and a client checking it would otherwise see a mix-up."""
        if oauth2_settings.COMPLIANT_BCP_RFC9700_AUTHZ_RESPONSE_ISS:
            parts = urlsplit(redirect_to)
            if not parts.fragment:  # code flow only: responses in the query
                query = [(key, value) for key, value in parse_qsl(parts.query, keep_blank_values=True) if key != "iss"]
                query.append(("iss", oauth2_settings.oauth2_authorization_server_issuer(self.request)))
                redirect_to = urlunsplit(parts._replace(query=urlencode(query)))
        response: HttpResponseRedirectBase = super().redirect(redirect_to, application)
        return response

    def _application(self, client_id: str) -> Any:
        if not client_id or has_nul(client_id):
            return None
        return get_application_model().objects.filter(client_id=client_id).first()

    def _error_page(self, error: str, description: str) -> HttpResponse:
        oauth_error = errors.CustomOAuth2Error(error=error, description=description)
        return self.render_to_response({"error": oauth_error, "view": self}, status=400)


def _unknown_resource(uri: str) -> str:
    return f"This server issues tokens for {settings.MCP_OAUTH_RESOURCE} only, not {uri[:200]}."
