"""Celery's own Django layout: the app, configured from Django's settings, and its Durable."""

from celery import Celery

from durable_celery.contrib.django import DjangoDurable

app = Celery("project", set_as_current=False)
app.config_from_object("django.conf:settings", namespace="CELERY")
durable = DjangoDurable(app)
