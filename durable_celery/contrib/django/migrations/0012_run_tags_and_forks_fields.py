"""The read-only models learn revision 0008's columns (a run's tags and forked_from, a step's
context): state only."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("durable_celery", "0011_run_tags_and_forks")]
    operations = [
        migrations.AddField("durablerun", "tags", models.JSONField(null=True)),
        migrations.AddField("durablerun", "forked_from", models.CharField(max_length=36, null=True)),
        migrations.AddField("durablestep", "context", models.JSONField(null=True)),
    ]
