"""Alembic revision 0007 of durable's tables (durable_celery/store/migrations): a run's progress."""

from django.db import migrations

from durable_celery.contrib.django.migrating import alembic_revision


class Migration(migrations.Migration):
    dependencies = [("durable_celery", "0008_run_flow_fields")]
    operations = [alembic_revision("0007")]
