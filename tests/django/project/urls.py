"""The admin, with durable's runs, steps and keys in it; the other tests call the ORM and durable
directly."""

from django.contrib import admin
from django.urls import path

urlpatterns = [path("admin/", admin.site.urls)]
