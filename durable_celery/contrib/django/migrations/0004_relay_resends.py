"""Alembic revision 0004 of durable's tables (durable_celery/store/migrations)."""

from django.db import migrations

from durable_celery.contrib.django.migrating import alembic_revision


class Migration(migrations.Migration):
    dependencies = [("durable_celery", "0003_node_steps")]
    operations = [alembic_revision("0004")]
