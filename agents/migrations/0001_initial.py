"""The agents' models move from the ``dispatch`` app to ``agents`` (docs/architecture.md#tables-keep-their-names):
state only — the tables keep their names (``Meta.db_table``), so every existing row stays."""

import agents.models
import django.db.models.deletion
import django.utils.timezone
from django.conf import settings
from django.db import migrations, models


class Migration(migrations.Migration):

    initial = True

    dependencies = [
        ('dispatch', '0006_mcp_stream'),
        ('core', '0001_initial'),
        ('peers', '0001_initial'),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.CreateModel(
                    name='SupervisorLease',
                    fields=[
                        ('host', models.CharField(max_length=255, primary_key=True, serialize=False)),
                        ('holder', models.CharField(max_length=40)),
                        ('expires_at', models.DateTimeField()),
                    ],
                    options={
                        'db_table': 'dispatch_supervisorlease',
                    },
                ),
                migrations.CreateModel(
                    name='Agent',
                    fields=[
                        ('id', models.CharField(default=agents.models.new_agent_id, editable=False, max_length=16, primary_key=True, serialize=False)),
                        ('name', models.CharField(max_length=100)),
                        ('type', models.CharField(max_length=40)),
                        ('status', models.CharField(choices=[('creating', 'Creating'), ('running', 'Running'), ('stopping', 'Stopping'), ('stopped', 'Stopped'), ('error', 'Error'), ('archived', 'Archived')], default='creating', max_length=10)),
                        ('cwd', models.CharField(max_length=4096)),
                        ('launched_by_peer', models.JSONField(blank=True, null=True)),
                        ('host', models.CharField(blank=True, max_length=255)),
                        ('full_access', models.BooleanField(default=False)),
                        ('latest_event_type', models.CharField(blank=True, max_length=20)),
                        ('latest_event_message', models.TextField(blank=True)),
                        ('latest_event_at', models.DateTimeField(blank=True, null=True)),
                        ('peer_agent_id', models.CharField(blank=True, max_length=64)),
                        ('stale', models.BooleanField(default=False)),
                        ('last_error', models.TextField(blank=True)),
                        ('created_at', models.DateTimeField(default=django.utils.timezone.now)),
                        ('updated_at', models.DateTimeField(default=django.utils.timezone.now)),
                        ('pane_hash', models.CharField(blank=True, max_length=64)),
                        ('pane_changed_at', models.DateTimeField(blank=True, null=True)),
                        ('stop_requested_at', models.DateTimeField(blank=True, null=True)),
                        ('stop_interrupted', models.BooleanField(default=False)),
                        ('launched_by', models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.SET_NULL, related_name='launched', to='agents.agent')),
                        ('owner', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='agents', to=settings.AUTH_USER_MODEL)),
                        ('parent', models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.SET_NULL, related_name='children', to='agents.agent')),
                        ('peer', models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.SET_NULL, related_name='shadow_agents', to='peers.peer')),
                    ],
                    options={
                        'db_table': 'dispatch_agent',
                    },
                ),
                migrations.CreateModel(
                    name='AgentMessage',
                    fields=[
                        ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                        ('sender_address', models.JSONField(blank=True, null=True)),
                        ('idempotency_key', models.CharField(blank=True, max_length=100)),
                        ('content', models.TextField()),
                        ('status', models.CharField(choices=[('queued', 'Queued'), ('delivered', 'Delivered'), ('failed', 'Failed'), ('dead', 'Dead')], default='queued', max_length=10)),
                        ('error', models.TextField(blank=True)),
                        ('created_at', models.DateTimeField(default=django.utils.timezone.now)),
                        ('delivered_at', models.DateTimeField(blank=True, null=True)),
                        ('peer', models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.SET_NULL, related_name='messages', to='peers.peer')),
                        ('recipient_agent', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='received_messages', to='agents.agent')),
                        ('sender_agent', models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.SET_NULL, related_name='sent_messages', to='agents.agent')),
                        ('sender_peer', models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.SET_NULL, related_name='messages_received', to='peers.peer')),
                        ('sender_user', models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.SET_NULL, related_name='agent_messages', to=settings.AUTH_USER_MODEL)),
                    ],
                    options={
                        'db_table': 'dispatch_agentmessage',
                    },
                ),
                migrations.CreateModel(
                    name='AgentToken',
                    fields=[
                        ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                        ('prefix', models.CharField(max_length=8)),
                        ('digest', models.CharField(max_length=64, unique=True)),
                        ('created_at', models.DateTimeField(default=django.utils.timezone.now)),
                        ('revoked_at', models.DateTimeField(blank=True, null=True)),
                        ('agent', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='tokens', to='agents.agent')),
                    ],
                    options={
                        'db_table': 'dispatch_agenttoken',
                    },
                ),
                migrations.CreateModel(
                    name='Run',
                    fields=[
                        ('id', models.CharField(default=agents.models.new_run_id, editable=False, max_length=16, primary_key=True, serialize=False)),
                        ('input', models.JSONField(default=dict)),
                        ('status', models.CharField(choices=[('queued', 'Queued'), ('running', 'Running'), ('succeeded', 'Succeeded'), ('failed', 'Failed'), ('cancelled', 'Cancelled')], default='queued', max_length=10)),
                        ('output', models.TextField(blank=True)),
                        ('error', models.TextField(blank=True)),
                        ('created_at', models.DateTimeField(default=django.utils.timezone.now)),
                        ('started_at', models.DateTimeField(blank=True, null=True)),
                        ('finished_at', models.DateTimeField(blank=True, null=True)),
                        ('claimed_by', models.CharField(blank=True, max_length=40)),
                        ('agent', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='runs', to='agents.agent')),
                    ],
                    options={
                        'db_table': 'dispatch_run',
                    },
                ),
                migrations.CreateModel(
                    name='AgentEvent',
                    fields=[
                        ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                        ('type', models.CharField(choices=[('working', 'Working'), ('blocked', 'Blocked'), ('waiting_user', 'Waiting User'), ('done', 'Done'), ('idle', 'Idle'), ('system', 'System')], max_length=20)),
                        ('message', models.TextField(blank=True)),
                        ('metadata', models.JSONField(blank=True, default=dict)),
                        ('created_at', models.DateTimeField(default=django.utils.timezone.now)),
                        ('mirrored', models.BooleanField(default=False)),
                        ('agent', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='events', to='agents.agent')),
                        ('run', models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.SET_NULL, related_name='events', to='agents.run')),
                    ],
                    options={
                        'db_table': 'dispatch_agentevent',
                    },
                ),
                migrations.AddIndex(
                    model_name='agent',
                    index=models.Index(fields=['owner', '-created_at', '-id'], name='agent_owner_created'),
                ),
                migrations.AddIndex(
                    model_name='agentmessage',
                    index=models.Index(fields=['recipient_agent', '-created_at'], name='agentmessage_recipient'),
                ),
                migrations.AddIndex(
                    model_name='run',
                    index=models.Index(fields=['status', 'created_at', 'id'], name='run_status_created'),
                ),
                migrations.AddIndex(
                    model_name='run',
                    index=models.Index(fields=['agent', '-created_at', '-id'], name='run_agent_created'),
                ),
                migrations.AddIndex(
                    model_name='agentevent',
                    index=models.Index(fields=['agent', '-created_at', '-id'], name='agentevent_agent_created'),
                ),
                migrations.AddConstraint(
                    model_name='agentevent',
                    constraint=models.UniqueConstraint(condition=models.Q(('mirrored', True)), fields=('agent', 'created_at', 'type'), name='agentevent_mirrored_unique'),
                ),
            ],
            database_operations=[],
        ),
    ]
