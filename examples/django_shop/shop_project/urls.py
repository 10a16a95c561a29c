"""The shop's URLs: ``POST /orders/`` places an order; the admin shows orders and durable's runs."""

from django.contrib import admin
from django.urls import path

from orders import views

urlpatterns = [
    path("orders/", views.create_order, name="create-order"),
    path("orders/<int:pk>/", views.order_detail, name="order-detail"),
    path("admin/", admin.site.urls),
]
