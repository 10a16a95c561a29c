"""WSGI entry point of the shop (``gunicorn shop_project.wsgi``)."""

import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "shop_project.settings")

application = get_wsgi_application()
