// Validates Gateway API objects (JSON lines on stdin) against the Gateway API's OpenAPI schemas, compiled
// by @kubernetes-models/gateway-api (installed by `make gateway-api-schemas` into .tools/gateway-api).
// Usage: node validate_gateway_api.mjs <.tools/gateway-api>; prints one line per object: "ok" or
// "invalid: <ajv messages>". Strict: unknown fields are errors, as the API server's strict field validation.
import { readFileSync } from "node:fs";
import { pathToFileURL } from "node:url";
import { join } from "node:path";

const pkg = join(process.argv[2], "node_modules", "@kubernetes-models", "gateway-api");
for (const line of readFileSync(0, "utf8").split("\n").filter(Boolean)) {
  const obj = JSON.parse(line);
  const [group, version] = obj.apiVersion.split("/");
  const module = await import(pathToFileURL(join(pkg, group, version, `${obj.kind}.js`)).href);
  try {
    new module[obj.kind](obj).validate();
    console.log("ok");
  } catch (e) {
    console.log(`invalid: ${e.message}`);
  }
}
