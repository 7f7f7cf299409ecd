"""Node-shared Envoy: xDS resources, bootstrap, ADS server and process supervisor."""
