"""The core models move from the ``dispatch`` app to ``core`` (docs/architecture.md#tables-keep-their-names):
state only — the tables keep their names (``Meta.db_table``), so every existing row stays."""

import core.models
import django.db.models.deletion
import django.utils.timezone
from django.conf import settings
from django.db import migrations, models


class Migration(migrations.Migration):

    initial = True

    dependencies = [
        ('dispatch', '0006_mcp_stream'),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.CreateModel(
                    name='InstanceIdentity',
                    fields=[
                        ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                        ('instance_id', models.CharField(default=core.models.new_instance_id, max_length=17, unique=True)),
                        ('display_name', models.CharField(default=core.models.default_instance_name, max_length=100)),
                        ('created_at', models.DateTimeField(default=django.utils.timezone.now)),
                        ('public_key', models.CharField(blank=True, max_length=64)),
                        ('private_key_encrypted', models.TextField(blank=True)),
                    ],
                    options={
                        'verbose_name': 'instance identity',
                        'verbose_name_plural': 'instance identity',
                        'db_table': 'dispatch_instanceidentity',
                    },
                ),
                migrations.CreateModel(
                    name='ServerProcess',
                    fields=[
                        ('id', models.CharField(max_length=40, primary_key=True, serialize=False)),
                        ('kind', models.CharField(choices=[('serve', 'Serve'), ('worker', 'Worker'), ('test', 'Test')], max_length=10)),
                        ('hostname', models.CharField(max_length=255)),
                        ('pid', models.PositiveIntegerField()),
                        ('started_at', models.DateTimeField(default=django.utils.timezone.now)),
                        ('heartbeat_at', models.DateTimeField(db_index=True, default=django.utils.timezone.now)),
                    ],
                    options={
                        'db_table': 'dispatch_serverprocess',
                    },
                ),
                migrations.CreateModel(
                    name='ApiToken',
                    fields=[
                        ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                        ('name', models.CharField(blank=True, max_length=100)),
                        ('prefix', models.CharField(max_length=8)),
                        ('digest', models.CharField(max_length=64, unique=True)),
                        ('created_at', models.DateTimeField(default=django.utils.timezone.now)),
                        ('last_used_at', models.DateTimeField(blank=True, null=True)),
                        ('expires_at', models.DateTimeField(blank=True, null=True)),
                        ('revoked_at', models.DateTimeField(blank=True, null=True)),
                        ('user', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='api_tokens', to=settings.AUTH_USER_MODEL)),
                    ],
                    options={
                        'db_table': 'dispatch_apitoken',
                        'ordering': ['-created_at'],
                    },
                ),
            ],
            database_operations=[],
        ),
    ]
