"""The subset of SPIRE's public API the agent speaks: the Delegated Identity API (X.509 part).

No generated ``_pb2`` module: grpcio-tools is not a dependency, so the descriptors are built
here by hand, mirroring ``spire-api-sdk``'s ``proto/spire/api/types/{spiffeid,selector,
x509svid}.proto`` and ``proto/spire/api/agent/delegatedidentity/v1/delegatedidentity.proto``.
Only the wire matters for interoperating with a real SPIRE agent, so package, message and
field names, numbers and types are exactly theirs; the JWT messages and methods are left out.
The descriptors live in a private pool so they can never clash with another copy of these
files in the process-wide default pool."""

from __future__ import annotations

from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

_F = descriptor_pb2.FieldDescriptorProto

TYPES_PACKAGE = "spire.api.types"
PACKAGE = "spire.api.agent.delegatedidentity.v1"
SERVICE = f"{PACKAGE}.DelegatedIdentity"
SUBSCRIBE_X509_SVIDS = f"/{SERVICE}/SubscribeToX509SVIDs"
SUBSCRIBE_X509_BUNDLES = f"/{SERVICE}/SubscribeToX509Bundles"


def _field(name: str, number: int, ftype: int, type_name: str = "",
           repeated: bool = False) -> descriptor_pb2.FieldDescriptorProto:
    f = _F(name=name, number=number, type=ftype,
           label=_F.LABEL_REPEATED if repeated else _F.LABEL_OPTIONAL)
    if type_name:
        f.type_name = type_name
    return f


def _message(name: str, *fields: descriptor_pb2.FieldDescriptorProto,
             nested: tuple[descriptor_pb2.DescriptorProto, ...] = ()
             ) -> descriptor_pb2.DescriptorProto:
    return descriptor_pb2.DescriptorProto(name=name, field=fields, nested_type=nested)


def _file(name: str, package: str, *messages: descriptor_pb2.DescriptorProto,
          deps: tuple[str, ...] = ()) -> descriptor_pb2.FileDescriptorProto:
    return descriptor_pb2.FileDescriptorProto(name=name, package=package, syntax="proto3",
                                              dependency=deps, message_type=messages)


def _files() -> list[descriptor_pb2.FileDescriptorProto]:
    """The four files, dependencies first (the order the pool needs)."""
    spiffeid = _file(
        "spire/api/types/spiffeid.proto", TYPES_PACKAGE,
        _message("SPIFFEID",
                 _field("trust_domain", 1, _F.TYPE_STRING),
                 _field("path", 2, _F.TYPE_STRING)))
    selector = _file(
        "spire/api/types/selector.proto", TYPES_PACKAGE,
        _message("Selector",
                 _field("type", 1, _F.TYPE_STRING),
                 _field("value", 2, _F.TYPE_STRING)))
    x509svid = _file(
        "spire/api/types/x509svid.proto", TYPES_PACKAGE,
        _message("X509SVID",
                 _field("cert_chain", 1, _F.TYPE_BYTES, repeated=True),
                 _field("id", 2, _F.TYPE_MESSAGE, f".{TYPES_PACKAGE}.SPIFFEID"),
                 _field("expires_at", 3, _F.TYPE_INT64),
                 _field("hint", 4, _F.TYPE_STRING)),
        deps=(spiffeid.name,))
    # map<string, bytes> ca_certificates = 1, as protoc lowers it: a repeated nested
    # "<Field>Entry" message (key = 1, value = 2) flagged as a map entry
    ca_entry = _message("CaCertificatesEntry",
                        _field("key", 1, _F.TYPE_STRING),
                        _field("value", 2, _F.TYPE_BYTES))
    ca_entry.options.map_entry = True
    delegated = _file(
        "spire/api/agent/delegatedidentity/v1/delegatedidentity.proto", PACKAGE,
        _message("X509SVIDWithKey",
                 _field("x509_svid", 1, _F.TYPE_MESSAGE, f".{TYPES_PACKAGE}.X509SVID"),
                 _field("x509_svid_key", 2, _F.TYPE_BYTES)),
        _message("SubscribeToX509SVIDsRequest",
                 _field("selectors", 1, _F.TYPE_MESSAGE, f".{TYPES_PACKAGE}.Selector",
                        repeated=True),
                 _field("pid", 2, _F.TYPE_INT32)),
        _message("SubscribeToX509SVIDsResponse",
                 _field("x509_svids", 1, _F.TYPE_MESSAGE, f".{PACKAGE}.X509SVIDWithKey",
                        repeated=True),
                 _field("federates_with", 2, _F.TYPE_STRING, repeated=True)),
        _message("SubscribeToX509BundlesRequest"),
        _message("SubscribeToX509BundlesResponse",
                 _field("ca_certificates", 1, _F.TYPE_MESSAGE,
                        f".{PACKAGE}.SubscribeToX509BundlesResponse.CaCertificatesEntry",
                        repeated=True),
                 nested=(ca_entry,)),
        deps=(selector.name, x509svid.name))
    service = delegated.service.add(name="DelegatedIdentity")
    for method, request, response in (
            ("SubscribeToX509SVIDs", "SubscribeToX509SVIDsRequest", "SubscribeToX509SVIDsResponse"),
            ("SubscribeToX509Bundles", "SubscribeToX509BundlesRequest",
             "SubscribeToX509BundlesResponse")):
        service.method.add(name=method, input_type=f".{PACKAGE}.{request}",
                           output_type=f".{PACKAGE}.{response}", server_streaming=True)
    return [spiffeid, selector, x509svid, delegated]


POOL = descriptor_pool.DescriptorPool()
for _proto in _files():
    POOL.Add(_proto)


def _cls(full_name: str) -> Any:
    # Any: dynamically built classes have no static field types for mypy to check.
    return message_factory.GetMessageClass(POOL.FindMessageTypeByName(full_name))


SPIFFEID = _cls(f"{TYPES_PACKAGE}.SPIFFEID")
Selector = _cls(f"{TYPES_PACKAGE}.Selector")
X509SVID = _cls(f"{TYPES_PACKAGE}.X509SVID")
X509SVIDWithKey = _cls(f"{PACKAGE}.X509SVIDWithKey")
SubscribeToX509SVIDsRequest = _cls(f"{PACKAGE}.SubscribeToX509SVIDsRequest")
SubscribeToX509SVIDsResponse = _cls(f"{PACKAGE}.SubscribeToX509SVIDsResponse")
SubscribeToX509BundlesRequest = _cls(f"{PACKAGE}.SubscribeToX509BundlesRequest")
SubscribeToX509BundlesResponse = _cls(f"{PACKAGE}.SubscribeToX509BundlesResponse")


def serialize(message: Any) -> bytes:
    """gRPC request/response serializer for any of the classes above."""
    data: bytes = message.SerializeToString()
    return data
