"""Foreign keys now name the moved models (``core.*``, ``agents.*``): state only, the
columns and their constraints already point at the same tables."""

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('agents', '0001_initial'),
        ('peers', '0001_initial'),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AlterField(
                    model_name='outboxmessage',
                    name='message',
                    field=models.OneToOneField(on_delete=django.db.models.deletion.CASCADE, related_name='outbox', to='agents.agentmessage'),
                ),
            ],
            database_operations=[],
        ),
    ]
