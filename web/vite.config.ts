// Vite build of the lowtide dashboard: served by the API at /ui/ (src/lowtide/api/dashboard.py).
import { defineConfig } from "vite";

export default defineConfig({
  base: "/ui/",
  build: {
    outDir: "../src/lowtide/web_dist",
    emptyOutDir: true,
    sourcemap: false,
    chunkSizeWarningLimit: 1000,
  },
});
