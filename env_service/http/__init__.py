"""The HTTP front: the FastAPI app (``service``), its connection and request budgets (``limits``), the shared
secret (``auth``) and the endpoint table shared with the client (``endpoints``)."""
