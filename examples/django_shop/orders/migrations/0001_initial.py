"""The orders table."""

from django.db import migrations, models


class Migration(migrations.Migration):
    initial = True

    dependencies: list[tuple[str, str]] = []

    operations = [
        migrations.CreateModel(
            name="Order",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("item", models.CharField(max_length=100)),
                ("quantity", models.PositiveIntegerField(default=1)),
                ("payment", models.CharField(blank=True, max_length=40)),
                ("run_id", models.CharField(blank=True, max_length=36)),
                ("fulfilled", models.BooleanField(default=False)),
                ("tracking", models.CharField(blank=True, max_length=40)),
                ("created_at", models.DateTimeField(auto_now_add=True)),
            ],
        ),
    ]
