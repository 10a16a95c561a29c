"""Alembic revision 0009 of durable's tables (durable_celery/store/migrations): indexes for
reads at volume.

Not atomic: the revision builds its indexes CONCURRENTLY, outside a transaction."""

from django.db import migrations

from durable_celery.contrib.django.migrating import alembic_revision


class Migration(migrations.Migration):
    atomic = False
    dependencies = [("durable_celery", "0012_run_tags_and_forks_fields")]
    operations = [alembic_revision("0009")]
