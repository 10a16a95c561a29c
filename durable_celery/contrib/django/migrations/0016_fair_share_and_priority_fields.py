"""The read-only run model learns revision 0011's columns (a run's place in line, its fair key
and priority): state only."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("durable_celery", "0015_fair_share_and_priority")]
    operations = [
        migrations.AddField("durablerun", "line_at", models.DateTimeField("in line at")),
        migrations.AddField("durablerun", "fair_key", models.CharField(max_length=255, null=True)),
        migrations.AddField("durablerun", "priority", models.IntegerField(null=True)),
    ]
