from django.apps import AppConfig


class OAuthConfig(AppConfig):
    name = "oauth"
    label = "oauth"
    verbose_name = "OAuth for MCP clients"
    default_auto_field = "django.db.models.BigAutoField"
