"""Celery's app for the shop, configured from Django's settings (``CELERY_*``), and its
DjangoDurable: runs, steps and keys live in the ``default`` database alias, and a start inside
``transaction.atomic()`` (every request here: ``ATOMIC_REQUESTS``) joins the request's transaction.

    celery -A shop_project worker --pool threads -l info
"""

import os

from celery import Celery
from durable_celery.contrib.django import DjangoDurable

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "shop_project.settings")

app = Celery("shop_project")
app.config_from_object("django.conf:settings", namespace="CELERY")
durable = DjangoDurable(app)
app.autodiscover_tasks(related_name="workflows")  # each app's workflows.py, for the worker
