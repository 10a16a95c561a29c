"""Alembic revision 0006 of durable's tables (durable_celery/store/migrations): flow control's
columns, and their indexes built CONCURRENTLY, which PostgreSQL runs outside a transaction, so
this migration is not atomic."""

from django.db import migrations

from durable_celery.contrib.django.migrating import alembic_revision


class Migration(migrations.Migration):
    atomic = False
    dependencies = [("durable_celery", "0006_read_only_models")]
    operations = [alembic_revision("0006")]
