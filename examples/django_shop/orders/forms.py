"""The order form the view validates: what to buy, how many, and a payment token."""

from django import forms

from .models import Order


class OrderForm(forms.ModelForm):
    """An order as a customer posts it."""

    payment_token = forms.CharField(max_length=100)

    class Meta:
        model = Order
        fields = ["item", "quantity"]

    def clean_quantity(self) -> int:
        """At least one."""
        quantity: int = self.cleaned_data["quantity"]
        if quantity < 1:
            raise forms.ValidationError("order at least one")
        return quantity
