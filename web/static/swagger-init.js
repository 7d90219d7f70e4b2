// Starts Swagger UI on /docs (server/api/docs.py). The page's policy allows no inline script, so
// the schema's URL comes from the container's data-openapi-url. validatorUrl: null, or Swagger UI
// would send the schema to an outside validator for its badge.
(function () {
  "use strict";
  var container = document.getElementById("swagger-ui");
  window.ui = SwaggerUIBundle({
    url: container.dataset.openapiUrl,
    dom_id: "#swagger-ui",
    layout: "BaseLayout",
    deepLinking: true,
    showExtensions: true,
    showCommonExtensions: true,
    validatorUrl: null,
    presets: [SwaggerUIBundle.presets.apis],
  });
})();
