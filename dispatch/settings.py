"""Dispatch settings, read once from the environment (and ``.env``).

Every variable is listed in ``.env.example`` and in the README. Helpers in
``core.conf`` raise ``ImproperlyConfigured`` on a bad value, naming the variable
(docs/operating.md#settings).
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import dj_database_url
from django.core.exceptions import ImproperlyConfigured
from dotenv import load_dotenv

from agents.types import parse_agent_types
from core.conf import (
    encryption_keys,
    env_bool,
    env_float,
    env_int,
    env_list,
    env_networks,
    env_secret,
    env_str,
    recorded_public_url,
    secret_key,
)

BASE_DIR = Path(__file__).resolve().parent.parent
load_dotenv(BASE_DIR / ".env", override=False)

# --- where state lives -----------------------------------------------------------------
_data_dir = Path(env_str("DISPATCH_DATA_DIR", "var")).expanduser()
DATA_DIR = _data_dir if _data_dir.is_absolute() else BASE_DIR / _data_dir
DATA_DIR.mkdir(parents=True, exist_ok=True)
# The client wheels and sdists `make dist` builds, served at /downloads/ (core.downloads).
_dist_dir = Path(env_str("DISPATCH_DIST_DIR", "dist")).expanduser()
DIST_DIR = _dist_dir if _dist_dir.is_absolute() else BASE_DIR / _dist_dir

DEBUG = env_bool("DEBUG", False)

DEFAULT_PUBLIC_URL = "http://127.0.0.1:8000"
# Where a running ``serve`` records the public URL it serves under
# (docs/operating.md#settings): a command run in another terminal (``peer_offer``, ``issue_token``) prints the
# address that server hands out, even when only ``make run PORT=…`` chose it.
PUBLIC_URL_RECORD = DATA_DIR / "public_url.json"


# DISPATCH_PUBLIC_URL (environment or .env), else the URL a running serve recorded, else the default.
PUBLIC_URL_SOURCE = "DISPATCH_PUBLIC_URL"
PUBLIC_URL = env_str("DISPATCH_PUBLIC_URL", "").rstrip("/")
if not PUBLIC_URL:
    PUBLIC_URL = recorded_public_url(PUBLIC_URL_RECORD).rstrip("/")
    PUBLIC_URL_SOURCE = str(PUBLIC_URL_RECORD)
if not PUBLIC_URL:
    PUBLIC_URL, PUBLIC_URL_SOURCE = DEFAULT_PUBLIC_URL, "default"
_public = urlsplit(PUBLIC_URL)
if _public.scheme not in ("http", "https") or not _public.hostname:
    raise ImproperlyConfigured(
        f"DISPATCH_PUBLIC_URL must be an http(s) URL such as http://127.0.0.1:8000, got {PUBLIC_URL!r}"
        + ("" if PUBLIC_URL_SOURCE == "DISPATCH_PUBLIC_URL" else f" (from {PUBLIC_URL_SOURCE})")
    )


SECRET_KEY, SECRET_KEY_FROM_LOCAL_FILE = secret_key(env_secret("SECRET_KEY"), DATA_DIR)


# MultiFernet keys for secrets at rest, newest first.
ENCRYPTION_KEYS = encryption_keys(env_list("DISPATCH_ENCRYPTION_KEYS", []), SECRET_KEY)

_local_hosts = ["localhost", "127.0.0.1", "[::1]"]
ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", [*_local_hosts, _public.hostname])
CSRF_TRUSTED_ORIGINS = [f"{_public.scheme}://{_public.netloc}"]
CSRF_FAILURE_VIEW = "core.views.csrf_failure"  # the JSON error shape under /api/

# Behind a reverse proxy (docs/operating.md#behind-a-proxy): ``serve`` takes each
# request's client address from the first ``X-Forwarded-For`` entry and its scheme from
# ``X-Forwarded-Proto`` (HTTP and websocket upgrades alike), and Django counts a request as
# HTTPS when ``X-Forwarded-Proto`` is ``https``. Only safe when the proxy *overwrites* both
# headers and nothing else reaches the ``serve`` port; off: both headers are ignored.
BEHIND_PROXY = env_bool("DISPATCH_BEHIND_PROXY", False)
# No USE_X_FORWARDED_HOST: the proxy passes the client's own ``Host`` (``proxy_set_header
# Host $http_host``, port included), which ALLOWED_HOSTS and the origin check compare.
SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https") if BEHIND_PROXY else None

# --- applications ----------------------------------------------------------------------
INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "channels",
    "rest_framework",
    "drf_spectacular",
    "drf_spectacular_sidecar",  # Swagger UI and Redoc served from here, not a CDN
    "django_htmx",
    "core",
    "remotes",
    "machines",
    "agents",
    "peers",
    "attention",
    "dispatch",
    "oauth2_provider",  # django-oauth-toolkit: the authorization server of /mcp/oauth
    "oauth",
]

MIDDLEWARE = [
    "core.outage.RetryAfterMiddleware",  # every 503 answer says when to retry
    "core.middleware.SecurityMiddleware",  # Django's, its hooks on the event loop (core.middleware)
    "core.http.ApiErrorShapeMiddleware",  # every error under /api/ in the JSON shape
    "core.static.AsyncWhiteNoiseMiddleware",
    "core.middleware.SessionMiddleware",
    "core.middleware.CommonMiddleware",
    "core.http.BearerCsrfExemptMiddleware",
    "core.middleware.CsrfViewMiddleware",
    "core.middleware.AuthenticationMiddleware",
    "core.middleware.LoginRequiredMiddleware",
    "core.middleware.MessageMiddleware",
    "core.middleware.XFrameOptionsMiddleware",
    "django_htmx.middleware.HtmxMiddleware",
    # Innermost, so its process_exception runs first: a view failing on an outage is a 503.
    "core.http.OutageMiddleware",
]

ROOT_URLCONF = "dispatch.urls"
ASGI_APPLICATION = "dispatch.asgi.application"
WSGI_APPLICATION = None

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

# Dependency deadline (docs/operating.md#bounds): seconds a request-path call to Redis (the
# channel layer, the rate limiters, the router's cache) or a new PostgreSQL connection may take
# before the request answers 503 TEMPORARILY_UNAVAILABLE naming the dependency, so a frozen
# Redis or database costs a request this long, not the 30 s of a socket timeout.
DEPENDENCY_TIMEOUT = env_float("DISPATCH_DEPENDENCY_TIMEOUT", 2.0)

# --- database --------------------------------------------------------------------------
DATABASE_URL = env_str("DATABASE_URL", "")
if DATABASE_URL:
    try:
        _default_db: dict[str, Any] = dict(dj_database_url.parse(DATABASE_URL))
    except ValueError as exc:
        raise ImproperlyConfigured(f"DATABASE_URL: {exc}") from None
else:
    _default_db = {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": str(DATA_DIR / "dispatch.sqlite3"),
        # One test database file per test process, so parallel runs never collide.
        "TEST": {"NAME": str(Path(tempfile.gettempdir()) / f"dispatch-test-{os.getpid()}.sqlite3")},
    }

if _default_db["ENGINE"] == "django.db.backends.sqlite3":
    # Every SQLite database (default or given): WAL, immediate transactions, 20 s busy
    # timeout (docs/operating.md#settings).
    _default_db.setdefault("OPTIONS", {}).update(
        {
            "transaction_mode": "IMMEDIATE",
            "timeout": 20,
            "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
        }
    )
# Connections per process (docs/deploy.md#pool-sizes). PostgreSQL: psycopg's pool,
# at most DISPATCH_DB_POOL_MAX per process (default 20: four processes fit the server's
# default max_connections=100); a query that finds every connection busy waits up to
# DISPATCH_DB_POOL_TIMEOUT seconds (on Channels' one shared sync thread, so briefly), then
# fails with OperationalError, which the API answers 503 TEMPORARILY_UNAVAILABLE. Django
# refuses a pool with persistent connections, so CONN_MAX_AGE is 0 (closing hands the
# connection back to the pool) and DISPATCH_DB_CONN_MAX_AGE is refused; the pool only hands
# out healthy connections, so no health-check round trip at every checkout.
# Other databases (SQLite: file handles, not server slots) keep connections open between
# queries: Channels closes "obsolete" connections around every database_sync_to_async
# call, and with CONN_MAX_AGE=0 that is every call.
DB_POOL_MIN = env_int("DISPATCH_DB_POOL_MIN", 2, minimum=0)
DB_POOL_MAX = env_int("DISPATCH_DB_POOL_MAX", 20, minimum=1)
DB_POOL_TIMEOUT = env_float("DISPATCH_DB_POOL_TIMEOUT", 5.0)  # seconds
if DB_POOL_MIN > DB_POOL_MAX:
    raise ImproperlyConfigured(
        f"DISPATCH_DB_POOL_MIN ({DB_POOL_MIN}) must not exceed DISPATCH_DB_POOL_MAX ({DB_POOL_MAX})"
    )
if _default_db["ENGINE"] == "django.db.backends.postgresql":
    if env_str("DISPATCH_DB_CONN_MAX_AGE", ""):
        raise ImproperlyConfigured(
            "DISPATCH_DB_CONN_MAX_AGE cannot be used with PostgreSQL: connections come from a pool "
            "(Django requires CONN_MAX_AGE=0 with it); unset it and size the pool with "
            "DISPATCH_DB_POOL_MAX / DISPATCH_DB_POOL_TIMEOUT"
        )
    _default_db.setdefault("OPTIONS", {})["pool"] = {
        "min_size": DB_POOL_MIN,
        "max_size": DB_POOL_MAX,
        "timeout": DB_POOL_TIMEOUT,
    }
    # libpq counts whole seconds (at least 2): a server that does not answer fails the
    # connection, not the request's whole pool timeout.
    _default_db["OPTIONS"].setdefault("connect_timeout", max(2, round(DEPENDENCY_TIMEOUT)))
    _default_db["CONN_MAX_AGE"] = 0
    _default_db["CONN_HEALTH_CHECKS"] = False
else:
    _default_db["CONN_MAX_AGE"] = env_int("DISPATCH_DB_CONN_MAX_AGE", 300, minimum=0)
    _default_db["CONN_HEALTH_CHECKS"] = True
DATABASES = {"default": _default_db}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# --- channel layer ---------------------------------------------------------------------
REDIS_URL = env_str("REDIS_URL", "")
_db_identity = DATABASE_URL or str(_default_db["NAME"])
# A short hash of the database: what sets this instance apart from another on the same host
# or Redis (the Redis prefix and the cookie names below).
_db_hash = hashlib.sha256(_db_identity.encode()).hexdigest()[:10]
REDIS_PREFIX = env_str("DISPATCH_REDIS_PREFIX", "dispatch-" + _db_hash)
# No glob characters: a reset of this instance's rate-limit counts deletes the keys matching
# "<prefix>:limits:*" (core.services.rate_limiter), which must not match another instance's.
if not re.fullmatch(r"[A-Za-z0-9_.:-]{1,100}", REDIS_PREFIX):
    raise ImproperlyConfigured(
        f"DISPATCH_REDIS_PREFIX must be 1-100 of A-Z, a-z, 0-9, '_', '.', ':' or '-', got {REDIS_PREFIX!r}"
    )
CHANNEL_CAPACITY = env_int("DISPATCH_CHANNEL_CAPACITY", 10_000, minimum=10_000)
# Redis connections per process (and event loop) for the channel layer and the router's
# cache; a caller that finds them all busy waits up to REDIS_POOL_TIMEOUT seconds.
REDIS_MAX_CONNECTIONS = env_int("DISPATCH_REDIS_MAX_CONNECTIONS", 200, minimum=2)
REDIS_POOL_TIMEOUT = env_float("DISPATCH_REDIS_POOL_TIMEOUT", 10.0)
# "pubsub": one PUBLISH per message to the owning process (core.pubsub_layer); "list":
# channels-redis' lists (core.channel_layer). docs/operating.md#channel-layer.
CHANNEL_LAYER_KIND = env_str("DISPATCH_CHANNEL_LAYER", "pubsub")
if CHANNEL_LAYER_KIND not in ("pubsub", "list"):
    raise ImproperlyConfigured(f"DISPATCH_CHANNEL_LAYER must be pubsub or list, got {CHANNEL_LAYER_KIND!r}")
if REDIS_URL:
    CHANNEL_LAYERS = {
        "default": {
            # "list": channels-redis with a pool that waits for a free connection instead
            # of failing the send (redis-py 8 caps a plain pool at 100 and raises).
            "BACKEND": (
                "core.pubsub_layer.PubSubChannelLayer"
                if CHANNEL_LAYER_KIND == "pubsub"
                else "core.channel_layer.RedisChannelLayer"
            ),
            "CONFIG": {
                "hosts": [
                    {
                        "address": REDIS_URL,
                        # The list layer's own blocking reads last 5 s: redis-py 8's default
                        # 5 s socket timeout would kill an idle consumer with TimeoutError.
                        # The pub/sub layer's subscription sets none and finds a dead
                        # connection by its heartbeat.
                        "socket_timeout": DEPENDENCY_TIMEOUT if CHANNEL_LAYER_KIND == "pubsub" else 30,
                        "socket_connect_timeout": DEPENDENCY_TIMEOUT,
                        "max_connections": REDIS_MAX_CONNECTIONS,
                        "pool_timeout": REDIS_POOL_TIMEOUT,
                    }
                ],
                "prefix": REDIS_PREFIX,
                # send / group_send / group_add / group_discard (core.channel_layer).
                "deadline": DEPENDENCY_TIMEOUT,
                "capacity": CHANNEL_CAPACITY,
                "expiry": 60,
                "group_expiry": 86400 * 7,
            },
        }
    }
else:
    CHANNEL_LAYERS = {
        "default": {
            # Channels' layer with an expiry sweep at most once a second (core.channel_layer).
            "BACKEND": "core.channel_layer.InMemoryChannelLayer",
            "CONFIG": {"capacity": CHANNEL_CAPACITY, "expiry": 60},
        }
    }

# --- auth ------------------------------------------------------------------------------
LOGIN_URL = "/login/"
LOGIN_REDIRECT_URL = "/"
LOGOUT_REDIRECT_URL = "/login/"
AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    # Not a rule: its password_changed hook closes the user's cookie websockets.
    {"NAME": "core.revocation.EndSessionsOnPasswordChange"},
]
SESSION_COOKIE_HTTPONLY = True
SESSION_COOKIE_SECURE = _public.scheme == "https"
CSRF_COOKIE_SECURE = _public.scheme == "https"
# Cookies ignore the port: two instances on one host would share sessionid/csrftoken and log
# each other out in one browser. Each instance's cookie names carry its database's hash.
COOKIE_PREFIX = env_str("DISPATCH_COOKIE_PREFIX", f"dispatch_{_db_hash}_")
if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", COOKIE_PREFIX):
    raise ImproperlyConfigured(
        f"DISPATCH_COOKIE_PREFIX must be 1-64 of A-Z, a-z, 0-9, '_', '.' or '-', got {COOKIE_PREFIX!r}"
    )
SESSION_COOKIE_NAME = COOKIE_PREFIX + "sessionid"
CSRF_COOKIE_NAME = COOKIE_PREFIX + "csrftoken"
# Flash messages live in the session, not in a "messages" cookie every instance would share.
MESSAGE_STORAGE = "django.contrib.messages.storage.session.SessionStorage"

# Password throttling (docs/ws-protocol.md#authentication): failures per username and per
# client address within the window before attempts are refused unchecked.
LOGIN_FAILURE_LIMIT = env_int("DISPATCH_LOGIN_FAILURE_LIMIT", 5, minimum=1)
LOGIN_FAILURE_WINDOW = env_int("DISPATCH_LOGIN_FAILURE_WINDOW", 600, minimum=1)  # seconds
RATELIMIT_STORAGE_URL = REDIS_URL or "memory://"

# --- OAuth 2.1 for MCP clients (docs/mcp.md#oauth) ---------------------------------------
# Dispatch is the authorization server of one protected resource, ``/mcp/oauth``; ``/mcp``
# stays header-token only. django-oauth-toolkit does the protocol; every RFC 9700 gate is on:
# S256 only, RFC 9207 ``iss`` in the redirect, tokens hashed at rest, refresh tokens rotated
# with reuse detection (a reused one revokes its family), no implicit or password grant.
MCP_OAUTH_PATH = "/mcp/oauth"
MCP_OAUTH_RESOURCE = PUBLIC_URL + MCP_OAUTH_PATH  # RFC 9728 ``resource``: the public URL, byte for byte
# The issuer has a path, so its RFC 8414 metadata is at /.well-known/oauth-authorization-server/oauth
# and nothing answers at the root one: Claude Code probes the root even for a server configured
# with a header token, and once it finds an authorization server there it drops the header (/mcp).
OAUTH_ISSUER = PUBLIC_URL + "/oauth"
OAUTH_ACCESS_TOKEN_SECONDS = env_int("DISPATCH_OAUTH_ACCESS_TOKEN_SECONDS", 3600, minimum=1)
OAUTH_REFRESH_TOKEN_SECONDS = env_int("DISPATCH_OAUTH_REFRESH_TOKEN_SECONDS", 30 * 86400, minimum=300)
OAUTH_REFRESH_GRACE_SECONDS = env_int("DISPATCH_OAUTH_REFRESH_GRACE_SECONDS", 10, minimum=0)
# Dynamic Client Registration (RFC 7591) is open: per-address rate and a cap on stored clients.
OAUTH_DCR_RATE = env_str("DISPATCH_OAUTH_DCR_RATE", "20/hour")  # per client address (``limits`` syntax)
OAUTH_DCR_MAX_CLIENTS = env_int("DISPATCH_OAUTH_DCR_MAX_CLIENTS", 1000, minimum=1)
OAUTH_DCR_UNUSED_SECONDS = env_int("DISPATCH_OAUTH_DCR_UNUSED_SECONDS", 86400, minimum=60)
# A client metadata document URL seen for the first time costs a fetch and a stored client.
OAUTH_CIMD_RATE = env_str("DISPATCH_OAUTH_CIMD_RATE", "30/hour")  # per client address (``limits`` syntax)
# The library's own models (named, since Dispatch's rows point at its access tokens).
OAUTH2_PROVIDER_APPLICATION_MODEL = "oauth2_provider.Application"
OAUTH2_PROVIDER_ACCESS_TOKEN_MODEL = "oauth2_provider.AccessToken"
OAUTH2_PROVIDER_REFRESH_TOKEN_MODEL = "oauth2_provider.RefreshToken"
OAUTH2_PROVIDER_GRANT_MODEL = "oauth2_provider.Grant"
OAUTH2_PROVIDER_ID_TOKEN_MODEL = "oauth2_provider.IDToken"
# RFC 8252 §7.1 private-use schemes native MCP clients register redirect URIs with (Cursor's
# DCR sends cursor://anysphere.cursor-mcp/oauth/callback beside an https and a loopback one),
# plus any named in DISPATCH_OAUTH_REDIRECT_SCHEMES. The code they carry is bound by PKCE.
OAUTH_PRIVATE_USE_SCHEMES = sorted(
    {"cursor", "vscode", "vscode-insiders", "windsurf", "jetbrains"}
    | {scheme.strip().lower() for scheme in env_str("DISPATCH_OAUTH_REDIRECT_SCHEMES", "").split(",") if scheme.strip()}
)
_web_schemes = {"http", "https", "javascript", "data", "file", "vbscript", "about", "blob", "ftp", "ws", "wss"}
if _web_schemes & set(OAUTH_PRIVATE_USE_SCHEMES):
    raise ImproperlyConfigured(
        "DISPATCH_OAUTH_REDIRECT_SCHEMES names private-use schemes of native apps, not "
        + ", ".join(sorted(_web_schemes & set(OAUTH_PRIVATE_USE_SCHEMES)))
    )
OAUTH2_PROVIDER = {
    "OIDC_ISS_ENDPOINT": OAUTH_ISSUER,  # the issuer (``iss``); its origin is every advertised endpoint's
    "OAUTH2_VALIDATOR_CLASS": "oauth.validators.DispatchOAuth2Validator",
    "SCOPES": {
        "mcp": "Every MCP tool",
        # Said on the consent page: an agent is a program that runs commands where it runs,
        # and answering its approvals lets it run more, so "no shell" does not hold with this.
        "mcp:agents": "Agents: list, read history, launch, message, answer their approvals — an agent runs "
        "commands on the machine it runs on",
        "mcp:remotes": "Call the functions of your connected remotes",
        "mcp:machines:read": "Machines: list them, read, list and describe files",
        "mcp:machines:write": "Machines: write, copy and delete files",
        "mcp:machines:shell": "Machines: run commands and pipes",
    },
    "DEFAULT_SCOPES": ["mcp"],
    "PKCE_REQUIRED": True,
    "ALLOW_LOCALHOST_LOOPBACK": True,  # RFC 8252 §7.3: http://localhost:<any port>/… as well as 127.0.0.1
    # http only for loopback, the others as oauth.validators.redirect_uri_problem says
    "ALLOWED_REDIRECT_URI_SCHEMES": ["http", "https", *OAUTH_PRIVATE_USE_SCHEMES],
    "AUTHORIZATION_CODE_EXPIRE_SECONDS": 60,
    "ACCESS_TOKEN_EXPIRE_SECONDS": OAUTH_ACCESS_TOKEN_SECONDS,
    "REFRESH_TOKEN_EXPIRE_SECONDS": OAUTH_REFRESH_TOKEN_SECONDS,
    "ROTATE_REFRESH_TOKEN": True,
    "REFRESH_TOKEN_REUSE_PROTECTION": True,
    # A client that sends two requests at once after its access token expired refreshes
    # twice with the same refresh token (the TypeScript SDK does): the one just rotated away
    # is honoured again for these seconds (oauth.validators: a new pair of the same family)
    # instead of being taken for theft. Any older one, or one revoked on purpose, still
    # revokes its family at once.
    "REFRESH_TOKEN_GRACE_PERIOD_SECONDS": OAUTH_REFRESH_GRACE_SECONDS,
    "REQUEST_APPROVAL_PROMPT": "force",  # the consent page every time: scopes are picked there
    "OAUTH2_RESPONSE_TYPES_SUPPORTED": ["code"],
    "OAUTH2_GRANT_TYPES_SUPPORTED": ["authorization_code", "refresh_token"],
    "OAUTH2_TOKEN_ENDPOINT_AUTH_METHODS_SUPPORTED": ["none", "client_secret_post", "client_secret_basic"],
    "COMPLIANT_BCP_RFC9700_IMPLICIT_GRANT": True,
    "COMPLIANT_BCP_RFC9700_PASSWORD_GRANT": True,
    "COMPLIANT_BCP_RFC9700_PKCE_METHOD": True,
    "COMPLIANT_BCP_RFC9700_ACCESS_TOKEN_TRANSPORT": True,
    "COMPLIANT_BCP_RFC9700_AUTHZ_RESPONSE_ISS": True,
    "COMPLIANT_BCP_RFC9700_TOKEN_STORAGE": True,
    "COMPLIANT_BCP_RFC9700_REFRESH_TOKEN": True,
    "COMPLIANT_BCP_RFC9700_REDIRECT_URI_SCHEME": True,
    "COMPLIANT_BCP_RFC9700_REDIRECT_URI_MATCHING": True,
    "COMPLIANT_BCP_RFC9700_PKCE_REQUIRED": True,
    "DCR_ENABLED": True,  # the admin switch is a row (oauth.models.OAuthPolicy), read per request
    "DCR_REGISTRATION_PERMISSION_CLASSES": ("oauth.registration.OpenRegistration",),
    "CIMD_ENABLED": True,  # likewise
    "CIMD_REGISTRATION_PERMISSION_CLASSES": ("oauth.registration.MetadataDocumentRegistration",),
    "CIMD_METADATA_FETCHER": "oauth.registration.MetadataDocumentFetcher",
    "CIMD_FETCH_TIMEOUT_SECONDS": env_float("DISPATCH_OAUTH_CIMD_TIMEOUT", 5.0),
    "CIMD_MAX_DOCUMENT_SIZE": 16 * 1024,
    "OAUTH2_PROTECTED_RESOURCE_IDENTIFIER": MCP_OAUTH_RESOURCE,
    "OAUTH2_PROTECTED_RESOURCE_AUTHORIZATION_SERVERS": [OAUTH_ISSUER],
    "OAUTH2_PROTECTED_RESOURCE_NAME": "Dispatch MCP",
}

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "core.authentication.BearerTokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "EXCEPTION_HANDLER": "core.api.exception_handler",
    # Strict JSON through core.wire: what the channel layer cannot carry is a 400.
    "DEFAULT_PARSER_CLASSES": [
        "core.http.WireJSONParser",
        "rest_framework.parsers.FormParser",
        "rest_framework.parsers.MultiPartParser",
    ],
    "DEFAULT_SCHEMA_CLASS": "dispatch.schema.AutoSchema",  # drf-spectacular's, with non-blank text
    "DEFAULT_CONTENT_NEGOTIATION_CLASS": "core.negotiation.JsonFallbackNegotiation",
    "UNAUTHENTICATED_USER": "django.contrib.auth.models.AnonymousUser",
}
SPECTACULAR_SETTINGS = {
    "TITLE": "Dispatch API",
    "DESCRIPTION": "Control plane for AI agents across several computers.",
    "VERSION": "1",
    # OpenAPI 3.1 is JSON Schema 2020-12: the body models' schemas (pydantic's anyOf/null)
    # are valid in it as they are (core/openapi.py).
    "OAS_VERSION": "3.1.0",
    "SERVE_INCLUDE_SCHEMA": False,
    # Like every other page and route: a login or a token (the README's promise).
    "SERVE_PERMISSIONS": ["rest_framework.permissions.IsAuthenticated"],
    # /api/docs/ and /api/redoc/ load nothing from another host: the UIs are static files of
    # drf-spectacular-sidecar (whitenoise), Redoc's page is ours (templates/dispatch/redoc.html:
    # no web fonts) and Swagger UI's validator badge (an image from validator.swagger.io) is off.
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    "SWAGGER_UI_SETTINGS": {"deepLinking": True, "validatorUrl": None},
    # The API's bodies are JSON: a form has no booleans, numbers or null for the strict
    # fields to read (DRF still parses one; it is not what the schema promises).
    "PARSER_WHITELIST": ["core.http.WireJSONParser"],
    # An approval's status appears in two answers (an approval, a hook's approval): one
    # enum, named, instead of drf-spectacular's hashed name for the collision. The values of
    # agents.models.Approval.Status (a pydantic enum is matched by its values alone).
    "ENUM_NAME_OVERRIDES": {"ApprovalStatusEnum": ["pending", "allowed", "denied", "expired"]},
    "POSTPROCESSING_HOOKS": [
        "drf_spectacular.hooks.postprocess_schema_enums",
        "core.openapi.add_documented_routes",
        "core.openapi.add_wire_values",  # free-form objects hold what core.wire reads
        "dispatch.schema.add_error_responses",
    ],
}

# --- static files ----------------------------------------------------------------------
STATIC_URL = "/static/"
STATICFILES_DIRS = [BASE_DIR / "static"]
STATIC_ROOT = DATA_DIR / "static"
STATIC_ROOT.mkdir(exist_ok=True)  # whitenoise warns about a missing root
WHITENOISE_USE_FINDERS = True
WHITENOISE_AUTOREFRESH = DEBUG

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True

# --- Dispatch runtime ------------------------------------------------------------------
# Presence (docs/operating.md#health): heartbeat period and time to live, seconds.
PROCESS_HEARTBEAT_INTERVAL = env_float("DISPATCH_HEARTBEAT_INTERVAL", 2.0)
PROCESS_TTL = env_float("DISPATCH_PROCESS_TTL", 10.0)
if PROCESS_TTL <= PROCESS_HEARTBEAT_INTERVAL:
    raise ImproperlyConfigured("DISPATCH_PROCESS_TTL must be longer than DISPATCH_HEARTBEAT_INTERVAL")
REAP_INTERVAL = env_float("DISPATCH_REAP_INTERVAL", 2.0)

# /ws session protocol (docs/ws-protocol.md#limits).
WS_MAX_MESSAGE_BYTES = env_int("DISPATCH_WS_MAX_MESSAGE_BYTES", 1024 * 1024, minimum=1024)
WS_RATE = env_float("DISPATCH_WS_RATE", 100.0)  # requests per second, per connection
WS_BURST = env_int("DISPATCH_WS_BURST", 500, minimum=1)
WS_AUTH_TIMEOUT = env_float("DISPATCH_WS_AUTH_TIMEOUT", 10.0)  # seconds
# Back-pressure on every websocket (/ws, /ws/shim/, peers), bytes a peer has not read yet
# (core.backpressure; docs/operating.md#bounds): above the high-water mark the socket is
# handed no new work; above the hard mark for longer than the grace it is closed (1013).
WS_HIGH_WATER = env_int("DISPATCH_WS_HIGH_WATER", 4 * 1024 * 1024, minimum=64 * 1024)
WS_HARD_LIMIT = env_int("DISPATCH_WS_HARD_LIMIT", 32 * 1024 * 1024, minimum=64 * 1024)
if WS_HARD_LIMIT < WS_HIGH_WATER:
    raise ImproperlyConfigured("DISPATCH_WS_HARD_LIMIT must be at least DISPATCH_WS_HIGH_WATER")
WS_HARD_GRACE = env_float("DISPATCH_WS_HARD_GRACE", 10.0)  # seconds
# Frames a client may have sent that its consumer has not taken yet; past it the socket is
# not read until half of them are (core.backpressure.ReadThrottle).
WS_INBOUND_FRAMES = env_int("DISPATCH_WS_INBOUND_FRAMES", 16, minimum=2)
# Remote calls in flight, counted where they were made (remotes.inflight;
# docs/operating.md#bounds): a call over a cap is refused at once. "Per user" counts within one process.
REMOTE_CALLS_PER_SESSION = env_int("DISPATCH_REMOTE_CALLS_PER_SESSION", 64, minimum=1)
REMOTE_CALL_BYTES_PER_SESSION = env_int("DISPATCH_REMOTE_CALL_BYTES_PER_SESSION", 64 * 1024 * 1024, minimum=1024)
REMOTE_CALLS_PER_USER = env_int("DISPATCH_REMOTE_CALLS_PER_USER", 256, minimum=1)
REMOTE_CALL_BYTES_PER_USER = env_int("DISPATCH_REMOTE_CALL_BYTES_PER_USER", 256 * 1024 * 1024, minimum=1024)
REMOTE_CALL_BYTES_PER_PROCESS = env_int("DISPATCH_REMOTE_CALL_BYTES_PER_PROCESS", 1024 * 1024 * 1024, minimum=1024)

# Machine operations in flight, counted where they were made (machines.services.admission;
# docs/operating.md#bounds): an operation over a cap is refused at once (RATE_LIMITED).
# "Per session" is a machine session of one user; "per user" counts within one process.
MACHINE_OPS_PER_SESSION = env_int("DISPATCH_MACHINE_OPS_PER_SESSION", 64, minimum=1)
MACHINE_OP_BYTES_PER_SESSION = env_int("DISPATCH_MACHINE_OP_BYTES_PER_SESSION", 64 * 1024 * 1024, minimum=1024)
MACHINE_OPS_PER_USER = env_int("DISPATCH_MACHINE_OPS_PER_USER", 256, minimum=1)
MACHINE_OP_BYTES_PER_USER = env_int("DISPATCH_MACHINE_OP_BYTES_PER_USER", 256 * 1024 * 1024, minimum=1024)
MACHINE_OP_BYTES_PER_PROCESS = env_int("DISPATCH_MACHINE_OP_BYTES_PER_PROCESS", 1024 * 1024 * 1024, minimum=1024)

# Remotes (docs/ws-protocol.md#remote-call), seconds.
REMOTE_CALL_TIMEOUT = env_float("DISPATCH_REMOTE_CALL_TIMEOUT", 30.0)
REMOTE_LIVENESS_INTERVAL = env_float("DISPATCH_REMOTE_LIVENESS_INTERVAL", 2.0)

# Shims (docs/shim-protocol.md#presence-and-takeover), seconds.
SHIM_HELLO_TIMEOUT = env_float("DISPATCH_SHIM_HELLO_TIMEOUT", 10.0)
SHIM_PING_INTERVAL = env_float("DISPATCH_SHIM_PING_INTERVAL", 30.0)
SHIM_PONG_TIMEOUT = env_float("DISPATCH_SHIM_PONG_TIMEOUT", 10.0)

# The expert agent's model (docs/agents.md#the-expert-agent): an OpenAI-compatible Chat Completions
# endpoint. Unset base URL: expert runs fail at once with a clear error.
# CLI agents: the tmux server (a ``tmux -L`` socket name; empty: Dispatch's own,
# ``tmux -L dispatch``, never the user's default; docs/agents.md).
TMUX_SOCKET = env_str("DISPATCH_TMUX_SOCKET", "")
# CLI agent types (docs/agents.md#agent-types): JSON, see agents/types.py; empty = defaults.
try:
    AGENT_TYPES = parse_agent_types(env_str("DISPATCH_AGENT_TYPES", ""))
except ValueError as exc:
    raise ImproperlyConfigured(str(exc)) from None
# Folders an admin trusts once for every user's Claude Code and codex agents: a launch in
# one of them, or below, needs no trust_folder (absolute; docs/agents.md#folder-trust).
TRUSTED_ROOTS = [os.path.normpath(os.path.expanduser(root)) for root in env_list("DISPATCH_TRUSTED_ROOTS", [])]
for _root in TRUSTED_ROOTS:
    if not os.path.isabs(_root):
        raise ImproperlyConfigured(f"DISPATCH_TRUSTED_ROOTS: {_root!r} is not an absolute folder")
# The CLI supervisor (docs/agents.md#the-supervisor), seconds: how often it reconciles (a doorbell wakes
# it sooner for a new message), how long an agent reported working may stay silent before
# the activity watcher marks it idle, the grace between a stop request and killing a CLI
# that has not exited after its stop keys (docs/agents.md#how-stop-works),
# and the hard limit on ``stopping``.
CLI_SUPERVISE_INTERVAL = env_float("DISPATCH_CLI_SUPERVISE_INTERVAL", 2.0, minimum=0.1)
AGENT_IDLE_AFTER = env_float("DISPATCH_AGENT_IDLE_AFTER", 180.0)
AGENT_STOP_GRACE = env_float("DISPATCH_AGENT_STOP_GRACE", 10.0)
AGENT_STOP_TIMEOUT = env_float("DISPATCH_AGENT_STOP_TIMEOUT", 60.0)
# Approvals (docs/agents.md#approvals): how long a CLI's permission request waits for an
# answer, in seconds, and the decision it gets when nobody answers in time ("deny" or
# "allow_once"); an agent type may set its own (DISPATCH_AGENT_TYPES approval_timeout,
# approval_default). The CLI's own hook timeout is set above it.
APPROVAL_TIMEOUT = env_int("DISPATCH_APPROVAL_TIMEOUT", 300, minimum=1)
APPROVAL_DEFAULT = env_str("DISPATCH_APPROVAL_DEFAULT", "deny")
if APPROVAL_DEFAULT not in ("deny", "allow_once"):
    raise ImproperlyConfigured(f"DISPATCH_APPROVAL_DEFAULT must be deny or allow_once, got {APPROVAL_DEFAULT!r}")
# Directories advertised to peers for incoming launches (docs/peers.md#launch); none: refused.
REPO_ROOTS = [os.path.realpath(os.path.expanduser(root)) for root in env_list("DISPATCH_REPO_ROOTS", [])]
OUTBOX_MAX_AGE = env_float("DISPATCH_OUTBOX_MAX_AGE", 7 * 86400.0, minimum=60.0)  # seconds; docs/peers.md#the-outbox
# Messages one signed POST carries to a peer that announced "messages.batch" (docs/peers.md#message-batches;
# also bounded by bytes under the body cap, and by the receiver's 500); 1: one POST a message.
PEER_BATCH_MESSAGES = env_int("DISPATCH_PEER_BATCH_MESSAGES", 50, minimum=1)
# Scales the peer mirror's reconnect back-off (docs/peers.md#shadow-agents; a test knob: 0.05 = 20× faster).
PEER_BACKOFF_SCALE = env_float("DISPATCH_PEER_BACKOFF_SCALE", 1.0, minimum=0.0)
# Where agents launched without a cwd work (MCP dispatch_launch_agent with a user token).
DEFAULT_CWD = env_str("DISPATCH_DEFAULT_CWD", "") or os.path.expanduser("~")

LLM_BASE_URL = env_str("DISPATCH_LLM_BASE_URL", "")
if LLM_BASE_URL and not LLM_BASE_URL.startswith(("http://", "https://")):
    raise ImproperlyConfigured(f"DISPATCH_LLM_BASE_URL must be an http(s) URL, got {LLM_BASE_URL!r}")
LLM_API_KEY = env_secret("DISPATCH_LLM_API_KEY") or ""
LLM_MODEL = env_str("DISPATCH_LLM_MODEL", "gpt-4o-mini")
TOOL_RESULT_MAX_CHARS = env_int("DISPATCH_TOOL_RESULT_MAX_CHARS", 20_000, minimum=100)
MAX_TOOL_STEPS = env_int("DISPATCH_MAX_TOOL_STEPS", 25, minimum=1)

# The daphne server's own websocket caps (serve): 16 MiB + 64 KiB (docs/shim-protocol.md#connecting).
SERVER_WS_MAX_BYTES = 16 * 1024 * 1024 + 64 * 1024
# Largest HTTP request body, bytes (docs/operating.md#limits). ``serve`` refuses a bigger one (413
# REQUEST_TOO_LARGE) before buffering it; Django's own in-memory limit and the MCP
# endpoint's follow. Default 16 MiB: a 10 MiB file write, base64 inside JSON (~14 MiB), fits.
MAX_REQUEST_BYTES = env_int("DISPATCH_MAX_REQUEST_BYTES", 16 * 1024 * 1024, minimum=64 * 1024)
DATA_UPLOAD_MAX_MEMORY_SIZE = MAX_REQUEST_BYTES
# Request bodies being read at once by this process, bytes (docs/operating.md#bounds): a
# request whose declared body would take the total over it is refused 503 with Retry-After
# before its body is read (dispatch.body_budget). At least DISPATCH_MAX_REQUEST_BYTES.
REQUEST_BODY_BUDGET = env_int("DISPATCH_REQUEST_BODY_BUDGET", max(64 * 1024 * 1024, MAX_REQUEST_BYTES), minimum=1)
if REQUEST_BODY_BUDGET < MAX_REQUEST_BYTES:
    raise ImproperlyConfigured(
        f"DISPATCH_REQUEST_BODY_BUDGET ({REQUEST_BODY_BUDGET}) must be at least DISPATCH_MAX_REQUEST_BYTES "
        f"({MAX_REQUEST_BYTES}): a body the server accepts must fit in it"
    )

# Who may read /metrics without a token (docs/metrics.md): client addresses (the TCP peer,
# never a forwarded header) in these networks; anyone else needs a staff user's API token.
METRICS_ALLOW = env_networks("DISPATCH_METRICS_ALLOW", ["127.0.0.0/8", "::1"])

# --- notifications (docs/notifications.md) -------------------------------------------------
# Web Push's VAPID key (RFC 8292): a P-256 private key (PEM, or raw/DER base64url as py_vapid
# reads it); unset: generated once into DATA_DIR/vapid_private_key.pem (mode 0600) and kept.
VAPID_PRIVATE_KEY = env_secret("DISPATCH_VAPID_PRIVATE_KEY") or ""
VAPID_KEY_FILE = DATA_DIR / "vapid_private_key.pem"
# The contact a push service may write to (RFC 8292 §2.1: a mailto: or https: URI).
VAPID_SUBJECT = env_str(
    "DISPATCH_VAPID_SUBJECT", PUBLIC_URL if _public.scheme == "https" else f"mailto:admin@{_public.hostname}"
)
if not VAPID_SUBJECT.startswith(("mailto:", "https://")):
    raise ImproperlyConfigured(f"DISPATCH_VAPID_SUBJECT must be a mailto: or https:// URI, got {VAPID_SUBJECT!r}")
# Delivery of a notification to one target: attempts before giving up, the first retry's
# delay (seconds; each next one four times longer), the per-send timeout (seconds), and how
# often the worker looks for due deliveries (seconds).
NOTIFY_MAX_ATTEMPTS = env_int("DISPATCH_NOTIFY_MAX_ATTEMPTS", 5, minimum=1)
NOTIFY_RETRY_BASE = env_float("DISPATCH_NOTIFY_RETRY_BASE", 10.0)
NOTIFY_SEND_TIMEOUT = env_float("DISPATCH_NOTIFY_SEND_TIMEOUT", 10.0, minimum=1.0)
NOTIFY_POLL_INTERVAL = env_float("DISPATCH_NOTIFY_POLL_INTERVAL", 1.0, minimum=0.05)
# How long an open agent page's "viewing" heartbeat holds its agent's pushes back (seconds;
# the page renews it every 15 s while visible).
NOTIFY_VIEWING_TTL = env_float("DISPATCH_NOTIFY_VIEWING_TTL", 45.0, minimum=1.0)
# Take push endpoints on this machine over plain http (a local push service: tests, trials).
# Off, only https endpoints of public hosts are taken (browsers only give those).
NOTIFY_PUSH_LOOPBACK_HTTP = env_bool("DISPATCH_NOTIFY_PUSH_LOOPBACK_HTTP", False)

LOG_LEVEL = env_str("DISPATCH_LOG_LEVEL", "INFO").upper()
if LOG_LEVEL not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
    raise ImproperlyConfigured(f"DISPATCH_LOG_LEVEL must be DEBUG, INFO, WARNING, ERROR or CRITICAL, got {LOG_LEVEL!r}")

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    # Expected 4xx answers (a device login's authorization_pending, a probe of a missing
    # /.well-known/ path) at DEBUG, a refused Host header one line (dispatch/log_filters.py).
    "filters": {
        "client_errors_at_debug": {"()": "dispatch.log_filters.ClientErrorsAtDebug"},
        "disallowed_host_one_line": {"()": "dispatch.log_filters.DisallowedHostOneLine"},
        # A 503 answer's "Service Unavailable" line: the outage is one WARNING (core.outage).
        "outage_responses_at_debug": {"()": "core.outage.OutageResponsesAtDebug"},
    },
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": LOG_LEVEL},
    "loggers": {
        "django.request": {"filters": ["client_errors_at_debug", "outage_responses_at_debug"]},
        "django.security.DisallowedHost": {"filters": ["disallowed_host_one_line"]},
        "daphne": {"level": "WARNING"},
        "django.channels.server": {"level": "WARNING"},
        # One "Terminating session: None" line per stateless MCP request, and one line per
        # outgoing peer request, are noise at INFO.
        "mcp.server.streamable_http": {"level": "WARNING"},
        "httpx": {"level": "WARNING"},
        # django-oauth-toolkit's sweep of expired tokens (the reaper's) says "0 … deleted" at INFO.
        "oauth2_provider.models": {"level": "WARNING"},
    },
}
