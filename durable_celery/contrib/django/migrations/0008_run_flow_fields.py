"""The read-only run model learns flow control's columns (revision 0006): state only, no SQL."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("durable_celery", "0007_flow_control")]
    operations = [
        migrations.AddField("durablerun", "slot_key", models.CharField(max_length=255, null=True)),
        migrations.AddField("durablerun", "throttle_key", models.CharField(max_length=255, null=True)),
        migrations.AddField("durablerun", "rate_key", models.CharField(max_length=255, null=True)),
        migrations.AddField("durablerun", "flow_wait", models.CharField(max_length=16, null=True)),
    ]
