"""The shop's URLs: ``POST /orders/`` places an order, ``POST /payments/`` takes a payment; the admin
shows orders and durable's runs."""

from django.contrib import admin
from django.urls import path

from orders import views

urlpatterns = [
    path("orders/", views.create_order, name="create-order"),
    path("orders/<int:pk>/", views.order_detail, name="order-detail"),
    path("payments/", views.create_payment, name="create-payment"),
    path("payments/<str:run_id>/", views.payment_detail, name="payment-detail"),
    path("payments/<str:run_id>/confirmation/", views.confirm_payment, name="confirm-payment"),
    path("admin/", admin.site.urls),
]
