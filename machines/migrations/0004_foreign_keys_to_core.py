"""Foreign keys now name the moved models (``core.*``, ``agents.*``): state only, the
columns and their constraints already point at the same tables."""

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('core', '0001_initial'),
        ('machines', '0003_machineconnection_credential'),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AlterField(
                    model_name='machineconnection',
                    name='api_token',
                    field=models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.SET_NULL, related_name='+', to='core.apitoken'),
                ),
                migrations.AlterField(
                    model_name='machineconnection',
                    name='server_process',
                    field=models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='machine_connections', to='core.serverprocess'),
                ),
            ],
            database_operations=[],
        ),
    ]
