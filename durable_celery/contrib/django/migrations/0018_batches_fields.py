"""The read-only run model learns revision 0012's column (the batch key a run gathered its
starts by): state only."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("durable_celery", "0017_batches")]
    operations = [
        migrations.AddField("durablerun", "batch_key", models.CharField(max_length=255, null=True)),
    ]
