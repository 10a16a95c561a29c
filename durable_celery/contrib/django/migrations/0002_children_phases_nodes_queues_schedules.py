"""Alembic revision 0002 of durable's tables (durable_celery/store/migrations)."""

from django.db import migrations

from durable_celery.contrib.django.migrating import alembic_revision


class Migration(migrations.Migration):
    dependencies = [("durable_celery", "0001_runs_steps_keys_activity_and_events")]
    operations = [alembic_revision("0002")]
