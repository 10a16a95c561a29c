"""Durable's tables as unmanaged, read-only models (models.py): state only, no SQL. Alembic's
revisions (0001-0005) create and change the tables; Django only learns their shape here."""

from django.db import migrations, models
from django.db.models.deletion import DO_NOTHING

UNMANAGED = {"managed": False}


def _run(related_name: str, **options: object) -> models.ForeignKey:
    """A reference to a run, without a database constraint (as in models.py)."""
    return models.ForeignKey(
        on_delete=DO_NOTHING,
        db_constraint=False,
        related_name=related_name,
        to="durable_celery.durablerun",
        **options,
    )


class Migration(migrations.Migration):
    dependencies = [("durable_celery", "0005_runs_deleted_trigger")]
    operations = [
        migrations.CreateModel(
            name="DurableRun",
            fields=[
                ("id", models.CharField(max_length=36, primary_key=True, serialize=False)),
                ("workflow", models.CharField(max_length=200)),
                ("status", models.CharField(max_length=24)),
                ("input", models.JSONField()),
                ("context", models.JSONField()),
                ("output", models.JSONField(null=True)),
                ("error", models.JSONField(null=True)),
                ("key", models.CharField(max_length=255, null=True)),
                ("runs_after", _run("+", null=True)),
                ("parent", _run("children", null=True)),
                ("parent_ref", models.CharField(max_length=200, null=True)),
                ("queue", models.CharField(max_length=200, null=True)),
                ("trace_parent", models.CharField(max_length=64, null=True)),
                ("step_index", models.IntegerField()),
                ("step_name", models.CharField(max_length=200, null=True)),
                ("attempt", models.IntegerField()),
                ("attempt_base", models.IntegerField()),
                ("fence", models.IntegerField()),
                ("locked_by", models.CharField(max_length=255, null=True)),
                ("heartbeat_at", models.DateTimeField(null=True)),
                ("due_at", models.DateTimeField(null=True)),
                ("published", models.BooleanField()),
                ("resends", models.IntegerField()),
                ("resend_at", models.DateTimeField(null=True)),
                ("not_after", models.DateTimeField(null=True)),
                ("deadline_at", models.DateTimeField(null=True)),
                ("wait_name", models.CharField(max_length=200, null=True)),
                ("wait_until", models.DateTimeField(null=True)),
                ("losses", models.IntegerField()),
                ("created_at", models.DateTimeField(verbose_name="created")),
                ("started_at", models.DateTimeField(null=True, verbose_name="started")),
                ("finished_at", models.DateTimeField(null=True, verbose_name="finished")),
            ],
            options={**UNMANAGED, "db_table": "durable_runs", "verbose_name": "run"},
        ),
        migrations.CreateModel(
            name="DurableStep",
            fields=[
                ("id", models.BigAutoField(primary_key=True, serialize=False)),
                ("run", _run("steps")),
                ("step_index", models.IntegerField()),
                ("phase", models.CharField(max_length=16)),
                ("name", models.CharField(max_length=200)),
                ("attempt", models.IntegerField()),
                ("status", models.CharField(max_length=24)),
                ("input", models.JSONField(null=True)),
                ("output", models.JSONField(null=True)),
                ("error", models.JSONField(null=True)),
                ("worker", models.CharField(max_length=255, null=True)),
                ("logs", models.JSONField(null=True)),
                ("started_at", models.DateTimeField(verbose_name="started")),
                ("finished_at", models.DateTimeField(verbose_name="finished")),
            ],
            options={**UNMANAGED, "db_table": "durable_steps", "verbose_name": "step"},
        ),
        migrations.CreateModel(
            name="DurableKey",
            fields=[
                (
                    "holder",
                    models.OneToOneField(
                        db_column="holder_id",
                        db_constraint=False,
                        on_delete=DO_NOTHING,
                        primary_key=True,
                        related_name="held_key",
                        serialize=False,
                        to="durable_celery.durablerun",
                    ),
                ),
                ("workflow", models.CharField(max_length=200)),
                ("key", models.CharField(max_length=255)),
                ("waiting", _run("+", null=True)),
                ("taken_at", models.DateTimeField(verbose_name="taken")),
            ],
            options={**UNMANAGED, "db_table": "durable_keys", "verbose_name": "key"},
        ),
        migrations.CreateModel(
            name="DurableActivity",
            fields=[
                ("id", models.BigAutoField(primary_key=True, serialize=False)),
                ("kind", models.CharField(max_length=40)),
                ("run", _run("activity", null=True)),
                ("workflow", models.CharField(max_length=200, null=True)),
                ("key", models.CharField(max_length=255, null=True)),
                ("details", models.JSONField()),
                ("at", models.DateTimeField()),
            ],
            options={
                **UNMANAGED,
                "db_table": "durable_activity",
                "verbose_name": "activity entry",
                "verbose_name_plural": "activity",
            },
        ),
        migrations.CreateModel(
            name="DurableSchedule",
            fields=[
                ("name", models.CharField(max_length=200, primary_key=True, serialize=False)),
                ("workflow", models.CharField(max_length=200)),
                ("key", models.CharField(max_length=255, null=True)),
                ("schedule", models.CharField(max_length=200)),
                ("input", models.JSONField(null=True)),
                ("enabled", models.BooleanField()),
                ("failures", models.IntegerField()),
                ("last_outcome", models.CharField(max_length=40, null=True)),
                ("last_run", _run("+", null=True)),
                ("last_fire_at", models.DateTimeField(null=True)),
                ("disabled_at", models.DateTimeField(null=True)),
                ("created_at", models.DateTimeField(verbose_name="created")),
                ("updated_at", models.DateTimeField(verbose_name="updated")),
            ],
            options={**UNMANAGED, "db_table": "durable_schedules", "verbose_name": "schedule"},
        ),
    ]
