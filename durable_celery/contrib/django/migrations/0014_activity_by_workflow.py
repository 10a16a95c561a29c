"""Alembic revision 0010 of durable's tables (durable_celery/store/migrations): the activity of a
workflow by kind and time.

Not atomic: the revision builds its index CONCURRENTLY, outside a transaction."""

from django.db import migrations

from durable_celery.contrib.django.migrating import alembic_revision


class Migration(migrations.Migration):
    atomic = False
    dependencies = [("durable_celery", "0013_reads_at_volume")]
    operations = [alembic_revision("0010")]
