"""Alembic revision 0001 of durable's tables (durable_celery/store/migrations)."""

from django.db import migrations

from durable_celery.contrib.django.migrating import alembic_revision


class Migration(migrations.Migration):
    dependencies: list[tuple[str, str]] = []
    operations = [alembic_revision("0001")]
