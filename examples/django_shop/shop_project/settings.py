"""Settings of the shop: PostgreSQL on psycopg 3 and a Redis broker, both from the environment.

SHOP_DB_NAME (django_shop)  SHOP_DB_HOST (127.0.0.1)  SHOP_DB_PORT (5432)
SHOP_DB_USER (postgres)     SHOP_DB_PASSWORD (none)   SHOP_BROKER_URL (redis://127.0.0.1:6379/0)
SHOP_QUEUE (shop): the Celery queue the workflows' steps go to
"""

import os

SECRET_KEY = os.environ.get("SHOP_SECRET_KEY", "django-shop-example-not-a-secret")
DEBUG = os.environ.get("SHOP_DEBUG", "") == "1"
ALLOWED_HOSTS = ["127.0.0.1", "localhost", "testserver"]

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "durable_celery.contrib.django",  # durable's tables as migrations, its runs in the admin
    "orders",
]

MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]

ROOT_URLCONF = "shop_project.urls"
WSGI_APPLICATION = "shop_project.wsgi.application"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",  # psycopg 3: durable needs it
        "NAME": os.environ.get("SHOP_DB_NAME", "django_shop"),
        "USER": os.environ.get("SHOP_DB_USER", "postgres"),
        "PASSWORD": os.environ.get("SHOP_DB_PASSWORD", ""),
        "HOST": os.environ.get("SHOP_DB_HOST", "127.0.0.1"),
        "PORT": os.environ.get("SHOP_DB_PORT", "5432"),
        # Every view runs in one transaction: a run started in it commits or rolls back with
        # the view's rows, and its first message is sent once the response's transaction commits.
        "ATOMIC_REQUESTS": True,
    },
}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
USE_TZ = True
TIME_ZONE = "UTC"
STATIC_URL = "static/"

# Celery, from these settings (shop_project/celery.py: namespace="CELERY").
CELERY_BROKER_URL = os.environ.get("SHOP_BROKER_URL", "redis://127.0.0.1:6379/0")
CELERY_TASK_DEFAULT_QUEUE = os.environ.get("SHOP_QUEUE", "shop")
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True

# durable_celery: every setting as CELERY_DURABLE_<NAME> (see docs/django.md).
CELERY_DURABLE_DATABASE_ALIAS = "default"  # runs, steps and keys live in this database
CELERY_DURABLE_JOIN_ATOMIC = True  # start() inside transaction.atomic() joins it
CELERY_DURABLE_POOL_SIZE = 5  # durable's own pool on that database: 5 kept, 5 more at peaks
CELERY_DURABLE_POLL_INTERVAL = 0.5  # the relay's and the waker's pass, in seconds
