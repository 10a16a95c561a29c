"""Alembic revision 0011 of durable's tables (durable_celery/store/migrations): fair share and
priority, a run's place in the lines of its flow limits.

Not atomic: the revision builds and drops its indexes CONCURRENTLY, outside a transaction."""

from django.db import migrations

from durable_celery.contrib.django.migrating import alembic_revision


class Migration(migrations.Migration):
    atomic = False
    dependencies = [("durable_celery", "0014_activity_by_workflow")]
    operations = [alembic_revision("0011")]
