"""Alembic revision 0008 of durable's tables (durable_celery/store/migrations): run tags and forks.

Not atomic: the revision builds its indexes CONCURRENTLY, outside a transaction."""

from django.db import migrations

from durable_celery.contrib.django.migrating import alembic_revision


class Migration(migrations.Migration):
    atomic = False
    dependencies = [("durable_celery", "0010_run_progress_field")]
    operations = [alembic_revision("0008")]
