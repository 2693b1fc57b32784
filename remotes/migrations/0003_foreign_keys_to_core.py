"""Foreign keys now name the moved models (``core.*``, ``agents.*``;
docs/architecture.md#tables-keep-their-names): state only, the columns and their constraints
already point at the same tables."""

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('core', '0001_initial'),
        ('remotes', '0002_wssession_credential'),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AlterField(
                    model_name='remote',
                    name='server_process',
                    field=models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='remotes', to='core.serverprocess'),
                ),
                migrations.AlterField(
                    model_name='wssession',
                    name='api_token',
                    field=models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.SET_NULL, related_name='+', to='core.apitoken'),
                ),
                migrations.AlterField(
                    model_name='wssession',
                    name='server_process',
                    field=models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='ws_sessions', to='core.serverprocess'),
                ),
            ],
            database_operations=[],
        ),
    ]
