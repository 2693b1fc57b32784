# A request id is unique per user, no longer the table's primary key. The table holds only
# operations in flight, which do not outlive the server processes that run them (an upgrade
# restarts those), so it is made anew rather than converted.

import django.db.models.deletion
import django.utils.timezone
from django.conf import settings
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('core', '0001_initial'),
        ('machines', '0006_audit_operation_id'),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.DeleteModel(name='OperationInFlight'),
        migrations.CreateModel(
            name='OperationInFlight',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('request_id', models.UUIDField()),
                ('session_id', models.CharField(max_length=256)),
                ('kind', models.CharField(choices=[('command', 'Command'), ('copy', 'Copy'), ('pipe', 'Pipe')], max_length=10)),
                ('op', models.CharField(max_length=40)),
                ('machine_ids', models.JSONField(default=list)),
                ('machine_names', models.JSONField(default=list)),
                ('shim_channels', models.JSONField(default=list)),
                ('protocol_versions', models.JSONField(default=list)),
                ('caller_channel', models.CharField(blank=True, max_length=200)),
                ('caller', models.CharField(max_length=200)),
                ('call_key', models.CharField(blank=True, db_index=True, max_length=300)),
                ('summary', models.CharField(blank=True, max_length=500)),
                ('started_at', models.DateTimeField(default=django.utils.timezone.now)),
                ('server_process', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='+', to='core.serverprocess')),
                ('user', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='+', to=settings.AUTH_USER_MODEL)),
            ],
            options={
                'ordering': ['-started_at'],
                'indexes': [models.Index(fields=['user', 'session_id'], name='machines_op_user_id_b7320d_idx')],
                'constraints': [models.UniqueConstraint(fields=('user', 'request_id'), name='machines_inflight_user_request_id')],
            },
        ),
    ]
