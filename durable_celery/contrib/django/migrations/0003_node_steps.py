"""Alembic revision 0003 of durable's tables (durable_celery/store/migrations)."""

from django.db import migrations

from durable_celery.contrib.django.migrating import alembic_revision


class Migration(migrations.Migration):
    dependencies = [("durable_celery", "0002_children_phases_nodes_queues_schedules")]
    operations = [alembic_revision("0003")]
