"""Settings of the Django project the Django tests run: PostgreSQL on psycopg 3 and a broker,
both given by the tests' conftest through the environment."""

import os

SECRET_KEY = "tests-only"
DEBUG = False
USE_TZ = True
ROOT_URLCONF = "tests.django.project.urls"
INSTALLED_APPS = [
    "django.contrib.contenttypes",
    "django.contrib.auth",
    "durable_celery.contrib.django",
    "tests.django.shop",
]
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": os.environ.get("DURABLE_DJANGO_DB", "durable_django"),
        "USER": os.environ.get("DURABLE_DJANGO_USER", "postgres"),
        "HOST": os.environ.get("DURABLE_DJANGO_HOST", "127.0.0.1"),
        "PORT": os.environ.get("DURABLE_DJANGO_PORT", "5432"),
    },
    # Not PostgreSQL: a DjangoDurable on it is refused.
    "lite": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"},
}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

CELERY_BROKER_URL = os.environ.get("DURABLE_DJANGO_BROKER", "memory://")
CELERY_TASK_DEFAULT_QUEUE = os.environ.get("DURABLE_DJANGO_QUEUE", "celery")
CELERY_DURABLE_POLL_INTERVAL = 0.1
CELERY_DURABLE_HEARTBEAT_INTERVAL = 0.5
CELERY_DURABLE_STALE_LOCK_TIMEOUT = 5.0
