"""The read-only run model learns the progress column (revision 0007): state only, no SQL."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("durable_celery", "0009_run_progress")]
    operations = [migrations.AddField("durablerun", "progress", models.JSONField(null=True))]
