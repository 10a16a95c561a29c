"""Settings of the Django project the Django tests run: PostgreSQL on psycopg 3 and a broker,
both given by the tests' conftest through the environment."""

import os

SECRET_KEY = "tests-only"
DEBUG = False
USE_TZ = True
ROOT_URLCONF = "tests.django.project.urls"
INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.contenttypes",
    "django.contrib.auth",
    "django.contrib.sessions",
    "django.contrib.messages",
    "durable_celery.contrib.django",
    "tests.django.shop",
]
# The admin (durable's runs, steps and keys), as the admin tests drive it with Django's Client.
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]
ALLOWED_HOSTS = ["testserver", "localhost"]
STATIC_URL = "/static/"
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
    # A read replica's alias, as projects name one; here it reads the same database (as Django's
    # TEST MIRROR does), so that the admin's reads can be told apart by their connection.
    "replica": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": os.environ.get("DURABLE_DJANGO_DB", "durable_django"),
        "USER": os.environ.get("DURABLE_DJANGO_USER", "postgres"),
        "HOST": os.environ.get("DURABLE_DJANGO_HOST", "127.0.0.1"),
        "PORT": os.environ.get("DURABLE_DJANGO_PORT", "5432"),
        "TEST": {"MIRROR": "default"},
    },
}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

CELERY_BROKER_URL = os.environ.get("DURABLE_DJANGO_BROKER", "memory://")
CELERY_TASK_DEFAULT_QUEUE = os.environ.get("DURABLE_DJANGO_QUEUE", "celery")
CELERY_DURABLE_POLL_INTERVAL = 0.1
CELERY_DURABLE_HEARTBEAT_INTERVAL = 0.5
CELERY_DURABLE_STALE_LOCK_TIMEOUT = 5.0
