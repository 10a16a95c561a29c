"""Alembic revision 0005 of durable's tables (durable_celery/store/migrations)."""

from django.db import migrations

from durable_celery.contrib.django.migrating import alembic_revision


class Migration(migrations.Migration):
    dependencies = [("durable_celery", "0004_relay_resends")]
    operations = [alembic_revision("0005")]
