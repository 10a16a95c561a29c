"""The read-only run model learns the tags and forked_from columns (revision 0008): state only."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("durable_celery", "0011_run_tags_and_forks")]
    operations = [
        migrations.AddField("durablerun", "tags", models.JSONField(null=True)),
        migrations.AddField("durablerun", "forked_from", models.CharField(max_length=36, null=True)),
    ]
