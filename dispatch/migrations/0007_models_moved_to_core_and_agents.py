"""The ``dispatch`` app gives its models to ``core`` and ``agents`` (docs/architecture.md#tables-keep-their-names).

State only — the tables keep their names, so every row stays — and then the content types
follow the models (``django_content_type.app_label``), so staff permissions and admin
history, which point at content types by id, survive the move."""

import django.db.models.deletion
from django.db import migrations, models

MOVED = {
    "core": ["instanceidentity", "serverprocess", "apitoken"],
    "agents": ["agent", "run", "agentevent", "agentmessage", "agenttoken", "supervisorlease"],
}


def content_types_follow(apps, schema_editor):
    """Relabel the moved models' content types; where the new label already has one (made
    by a ``post_migrate`` between the two steps), that empty newcomer gives way to the old
    row, which the permissions and the admin log point at."""
    ContentType = apps.get_model("contenttypes", "ContentType")
    db = schema_editor.connection.alias
    for app_label, models_ in MOVED.items():
        for model in models_:
            old = ContentType.objects.using(db).filter(app_label="dispatch", model=model).first()
            if old is None:
                continue
            ContentType.objects.using(db).filter(app_label=app_label, model=model).delete()
            old.app_label = app_label
            old.save(update_fields=["app_label"])


def content_types_return(apps, schema_editor):
    ContentType = apps.get_model("contenttypes", "ContentType")
    db = schema_editor.connection.alias
    for app_label, models_ in MOVED.items():
        ContentType.objects.using(db).filter(app_label=app_label, model__in=models_).update(app_label="dispatch")


class Migration(migrations.Migration):

    dependencies = [
        ('agents', '0001_initial'),
        ('contenttypes', '0002_remove_content_type_name'),
        ('core', '0001_initial'),
        ('dispatch', '0006_mcp_stream'),
        ('machines', '0004_foreign_keys_to_core'),
        ('peers', '0002_foreign_key_to_agents'),
        ('remotes', '0003_foreign_keys_to_core'),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.RemoveField(
                    model_name='agent',
                    name='launched_by',
                ),
                migrations.RemoveField(
                    model_name='agent',
                    name='owner',
                ),
                migrations.RemoveField(
                    model_name='agent',
                    name='parent',
                ),
                migrations.RemoveField(
                    model_name='agent',
                    name='peer',
                ),
                migrations.RemoveField(
                    model_name='agentmessage',
                    name='recipient_agent',
                ),
                migrations.RemoveField(
                    model_name='agentevent',
                    name='agent',
                ),
                migrations.RemoveField(
                    model_name='agentmessage',
                    name='sender_agent',
                ),
                migrations.RemoveField(
                    model_name='run',
                    name='agent',
                ),
                migrations.RemoveField(
                    model_name='agenttoken',
                    name='agent',
                ),
                migrations.RemoveField(
                    model_name='agentevent',
                    name='run',
                ),
                migrations.RemoveField(
                    model_name='agentmessage',
                    name='peer',
                ),
                migrations.RemoveField(
                    model_name='agentmessage',
                    name='sender_peer',
                ),
                migrations.RemoveField(
                    model_name='agentmessage',
                    name='sender_user',
                ),
                migrations.AlterField(
                    model_name='mcpstream',
                    name='agent_token',
                    field=models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.CASCADE, related_name='+', to='agents.agenttoken'),
                ),
                migrations.RemoveField(
                    model_name='apitoken',
                    name='user',
                ),
                migrations.AlterField(
                    model_name='mcpstream',
                    name='api_token',
                    field=models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.CASCADE, related_name='+', to='core.apitoken'),
                ),
                migrations.DeleteModel(
                    name='InstanceIdentity',
                ),
                migrations.AlterField(
                    model_name='mcpstream',
                    name='server_process',
                    field=models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='mcp_streams', to='core.serverprocess'),
                ),
                migrations.DeleteModel(
                    name='SupervisorLease',
                ),
                migrations.DeleteModel(
                    name='Agent',
                ),
                migrations.DeleteModel(
                    name='AgentEvent',
                ),
                migrations.DeleteModel(
                    name='Run',
                ),
                migrations.DeleteModel(
                    name='AgentMessage',
                ),
                migrations.DeleteModel(
                    name='AgentToken',
                ),
                migrations.DeleteModel(
                    name='ApiToken',
                ),
                migrations.DeleteModel(
                    name='ServerProcess',
                ),
            ],
            database_operations=[],
        ),
        migrations.RunPython(content_types_follow, content_types_return),
    ]
