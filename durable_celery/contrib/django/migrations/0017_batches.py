"""Alembic revision 0012 of durable's tables (durable_celery/store/migrations): batches, a batch
workflow's open batches and the batch key of a run that gathered starts."""

from django.db import migrations

from durable_celery.contrib.django.migrating import alembic_revision


class Migration(migrations.Migration):
    dependencies = [("durable_celery", "0016_fair_share_and_priority_fields")]
    operations = [alembic_revision("0012")]
