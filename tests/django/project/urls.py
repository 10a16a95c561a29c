"""No views: the tests call the ORM and durable directly."""

urlpatterns: list[object] = []
