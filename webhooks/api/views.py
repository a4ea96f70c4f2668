"""The webhooks API: list and create webhooks, show, change and delete one, its deliveries, redeliver one."""

from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import status
from rest_framework.generics import ListAPIView
from rest_framework.response import Response
from rest_framework.views import APIView

from audit.services import Actor
from common.errors import NotFound
from common.http import error_responses
from common.serializers import refuse_fields

from .. import permissions, services
from ..models import Webhook
from ..selectors import webhook_deliveries
from .serializers import DeliverySerializer, WebhookSerializer, WebhookUpdateSerializer, WebhookWriteSerializer

TAGS = ["webhooks"]


def _webhook_or_404(webhook_id):
    hook = Webhook.objects.select_related("created_by").filter(pk=webhook_id).first()
    if hook is None:
        raise NotFound(f"webhook {webhook_id} does not exist")
    return hook


class WebhookListView(ListAPIView):
    operator_permissions = {"GET": permissions.VIEW_WEBHOOKS, "POST": permissions.ADD_WEBHOOKS}
    serializer_class = WebhookSerializer

    def get_queryset(self):
        return Webhook.objects.select_related("created_by").order_by("created_at")

    @extend_schema(tags=TAGS, summary="List webhooks", responses={200: WebhookSerializer(many=True), **error_responses(400, 401, 403)})
    def get(self, request, *args, **kwargs):
        return super().get(request, *args, **kwargs)

    @extend_schema(
        tags=TAGS,
        summary="Create a webhook (its secret is never shown again)",
        request=WebhookWriteSerializer,
        responses={201: WebhookSerializer, **error_responses(400, 401, 403, 413)},
    )
    def post(self, request):
        serializer = WebhookWriteSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        hook = services.webhook_create(**serializer.validated_data, actor=Actor.for_request(request))
        return Response(WebhookSerializer(hook).data, status=status.HTTP_201_CREATED)


class WebhookDetailView(APIView):
    operator_permissions = {
        "GET": permissions.VIEW_WEBHOOKS,
        "PATCH": permissions.CHANGE_WEBHOOKS,
        "DELETE": permissions.DELETE_WEBHOOKS,
    }

    @extend_schema(tags=TAGS, summary="Show one webhook", responses={200: WebhookSerializer, **error_responses(401, 403, 404)})
    def get(self, request, webhook_id):
        return Response(WebhookSerializer(_webhook_or_404(webhook_id)).data)

    @extend_schema(
        tags=TAGS,
        summary="Change a webhook's URL, events, secret, format or whether it is active",
        request=WebhookUpdateSerializer,
        responses={200: WebhookSerializer, **error_responses(400, 401, 403, 404, 413)},
    )
    def patch(self, request, webhook_id):
        _webhook_or_404(webhook_id)
        serializer = WebhookUpdateSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        changes = {name: value for name, value in serializer.validated_data.items() if name in request.data}
        hook = services.webhook_update(webhook_id=webhook_id, actor=Actor.for_request(request), **changes)
        return Response(WebhookSerializer(hook).data)

    @extend_schema(
        tags=TAGS,
        summary="Delete a webhook and its deliveries",
        responses={204: OpenApiResponse(description="Deleted"), **error_responses(401, 403, 404)},
    )
    def delete(self, request, webhook_id):
        services.webhook_delete(webhook_id=webhook_id, actor=Actor.for_request(request))
        return Response(status=status.HTTP_204_NO_CONTENT)


class DeliveryListView(ListAPIView):
    operator_permissions = {"GET": permissions.VIEW_WEBHOOKS}
    serializer_class = DeliverySerializer

    def get_queryset(self):
        _webhook_or_404(self.kwargs["webhook_id"])
        return webhook_deliveries(self.kwargs["webhook_id"]).prefetch_related("attempt_rows")

    @extend_schema(
        tags=TAGS,
        summary="A webhook's deliveries, newest first, each with its attempts",
        responses={200: DeliverySerializer(many=True), **error_responses(400, 401, 403, 404)},
    )
    def get(self, request, *args, **kwargs):
        return super().get(request, *args, **kwargs)


class DeliveryRedeliverView(APIView):
    operator_permissions = {"POST": permissions.REDELIVER_WEBHOOKS}

    @extend_schema(
        tags=TAGS,
        summary="Send a delivered or failed delivery again (same id and body), retried as a new one",
        request=None,
        responses={202: DeliverySerializer, **error_responses(400, 401, 403, 404, 409)},
    )
    def post(self, request, webhook_id, delivery_id):
        refuse_fields(request.data)
        delivery = services.delivery_redeliver(delivery_id=delivery_id, webhook_id=webhook_id, actor=Actor.for_request(request))
        return Response(DeliverySerializer(delivery).data, status=status.HTTP_202_ACCEPTED)
